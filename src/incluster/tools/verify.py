"""``incluster verify DIR... [--step N]``: check every stored copy, byte for byte.

Each copy is read through the same strict path a restore uses (sidecar, size, every
chunk checksum, the header, and every tensor the state tree names). Exits 1 on a fault,
printing the file and the reason for each: a corrupt copy, a rank all of whose copies
are corrupt, a job with no step every rank has a good copy of, or - with ``--step`` -
that step lacking a rank. Exits 3 (a warning) when the job is restorable, but from an
older step than an incomplete newer one some rank holds: what a crash leaves (a save in
flight) and also what a node lost with its copies leaves - the listing cannot tell them
apart. Folders that hold only some of a job's ranks (one node's RAM) are not judged for
restorability, only checked. Leftovers of crashes and spare slots are info.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from incluster.tools.ls import ranges
from incluster.tools.models import Copy, world_size
from incluster.tools.ui import check_copies, consoles, human, line, load


def run(args: argparse.Namespace) -> int:
    out, err = consoles()
    inv = load(args, err)
    if inv is None:
        return 2
    where = ", ".join(args.dirs + args.persistent)
    steps = every = inv.steps()
    if args.step is not None:
        steps = {k: v for k, v in steps.items() if k[1] == args.step}
    problems = [text for job, step, text in inv.problems if args.step is None or step == args.step]
    if not steps and not problems:
        what = f"step {args.step}" if args.step is not None else "checkpoints"
        there = sorted({s for _, s in every})
        held = f" (it holds step{'s' if len(there) != 1 else ''} {', '.join(map(str, there))})" if there else ""
        line(out, "[red]FAULT:[/]", f"no {what} found under {where}{held}{inv.elsewhere(args.job)}"
                                    f"{inv.rank_folders(args.dirs)}")
        return 1
    copies = [c for ranks in steps.values() for cs in ranks.values() for c in cs]
    results = check_copies(copies, err)

    faults: list[str] = []
    summary = Table(title="incluster verify", title_justify="left")
    for col in ("job", "step", "ranks ok", "copies ok", "verified", "result"):
        summary.add_column(col, justify="right" if col in ("step", "ranks ok", "copies ok", "verified") else "left")
    incomplete = 0
    infos: list[str] = []
    warnings: list[str] = []
    restorable: dict[str, int] = {}  # job -> newest step with a good copy of every rank
    partial = inv.partial_views(steps)  # job -> ranks no scanned folder holds at all
    newer: dict[str, list[int]] = {}  # job -> incomplete steps newer than its restorable one
    for (job, step), ranks in steps.items():
        good = [c for cs in ranks.values() for c in cs if results[id(c)] is None]
        bad = [c for cs in ranks.values() for c in cs if results[id(c)] is not None]
        faults.extend(str(results[id(c)]) for c in bad)
        w, why = world_size(ranks)
        words: list[str] = []
        if w is None:
            faults.append(f"job {job} step {step}: world size unknown ({why})")
            words.append(why or "unknown world size")
            lacking: list[int] = []
        else:
            lacking = [r for r in range(w) if not any(results[id(c)] is None for c in ranks.get(r, []))]
            absent = [r for r in lacking if not ranks.get(r)]
            for r in lacking:
                if ranks.get(r):
                    faults.append(f"job {job} step {step}: rank {r} cannot be restored: all {len(ranks[r])} of "
                                  f"its copies are corrupt")
            if absent and job in partial:
                pass  # said once per job below: these folders are not the whole job
            elif absent and args.step is not None:
                faults.extend(f"job {job} step {step}: rank {r} cannot be restored: it has no copy with a sidecar "
                              f"anywhere" for r in absent)
            elif absent:
                infos.append(f"job {job} step {step}: rank {ranges(absent)} has no copy: not restorable")
                if job not in restorable:
                    newer.setdefault(job, []).append(step)
            if lacking:
                words.append(f"incomplete: no copy of rank {ranges(lacking)}")
            elif job not in restorable:  # steps come newest first
                restorable[job] = step
        if w is None or lacking:
            incomplete += 1
        if bad:
            words.append(f"{len(bad)} corrupt cop{'y' if len(bad) == 1 else 'ies'}")
        ok_ranks = len({c.rank for c in good})
        summary.add_row(job, str(step), f"{ok_ranks}/{w if w is not None else '?'}", f"{len(good)}/{len(good) + len(bad)}",
                        human(sum(c.nbytes for c in good)),
                        f"[red]{'; '.join(words)}[/]" if words else "[green]ok[/]")
    faults.extend(problems)
    for job, missing in sorted(partial.items()):
        infos.append(f"job {job}: no folder given holds rank(s) {ranges(missing)}; pass every node's folder (or "
                     f"--persistent) to judge which step a restore would use")
    for job in sorted({job for job, _ in steps} - set(restorable) - set(partial)):
        if args.step is None:
            faults.append(f"job {job}: no step has a good copy of every rank; a restore finds nothing to load")
    for job, later in sorted(newer.items()):
        if job in restorable:
            warnings.append(
                f"job {job}: a restore would use step {restorable[job]}, but step(s) {', '.join(map(str, later))} "
                f"are newer and incomplete: a save in flight at a crash (harmless: the restart clears it) or "
                f"copies lost with their node (that progress is gone)")
    out.print(summary)
    for f in faults:
        line(out, "[red]FAULT:[/]", f)
    for text in warnings:
        line(out, "[yellow]WARNING:[/]", text)
    for text in infos:
        line(out, "[dim]info:[/]", text)
    for note in inv.notes:
        line(out, "[dim]info:[/]", f"{note.path}: {note.what} (not a fault)")
    for job, step in sorted(restorable.items()):
        if args.step is not None:  # only that step was looked at: a newer one may exist
            line(out, "[green]restorable:[/]", f"job {job}: step {step} has a good copy of every rank")
        else:
            line(out, "[green]restorable:[/]", f"job {job}: newest step with a good copy of every rank is {step}")
    corrupt = sum(1 for c in copies if results[id(c)] is not None)
    verdict = "[red]FAILED[/]" if faults else "[yellow]WARNING[/]" if warnings else "[green]OK[/]"
    out.print(f"{verdict}: {len(copies)} cop{'y' if len(copies) == 1 else 'ies'} checked, {corrupt} corrupt, {len(steps)} step{'s' if len(steps) != 1 else ''}, {incomplete} incomplete, "
              f"{len(faults)} fault{'s' if len(faults) != 1 else ''}, {len(inv.notes) + len(infos)} info")
    return 1 if faults else WARNED if warnings else 0


WARNED = 3  # restorable, but not the newest step some rank holds
