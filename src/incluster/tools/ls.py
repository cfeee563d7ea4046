"""``incluster ls DIR...``: what is stored, step by step (sidecars and manifests only).

Fast: reads commit records and the shard files' sizes, never shard bytes (``incluster
verify`` checks those). A step is *complete* when every rank 0..W-1 (W from the sidecars)
has at least one copy, in any tier, with a readable sidecar and a shard file of the size
it records; a step whose missing ranks are in no folder listed (one node's RAM folder of
a multi-node job) is marked as such, not incomplete. Exits 0, or 1 when ``--job`` names
a job that is not there, or when nothing is found and a DIR is one rank's or one tier
step's folder (copies are not looked for there), 2 when the DIRs cannot be read.
"""

from __future__ import annotations

import argparse

from rich import box
from rich.table import Table

from incluster.recovery.meet import ranges
from incluster.tools.models import Copy, Inventory, missing_ranks, world_size
from incluster.tools.ui import consoles, human, line, load


def status(ranks: dict[int, list[Copy]], unseen: list[int] | None = None) -> tuple[bool | None, str]:
    """(complete, words) for one step, from its sidecars; complete None when the ranks it
    lacks are ranks ``unseen`` (no folder listed holds them: it may be complete)."""
    w, why = world_size(ranks)
    if w is None:
        return False, f"unknown: {why}"
    missing = missing_ranks(ranks)
    if missing and unseen and set(missing) <= set(unseen):
        return None, f"rank {ranges(missing)} not in the folders listed"
    if missing:
        return False, f"incomplete: no copy of rank {ranges(missing)}"
    damaged = missing_ranks(ranks, lambda c: c.sidecar is not None and c.damage is None) or []
    if damaged:
        return False, f"incomplete: every copy of rank {ranges(damaged)} is damaged"
    strays = sorted(r for r in ranks if r >= w)
    if strays:
        return False, f"inconsistent: rank {ranges(strays)} beyond world size {w}"
    bad = sum(1 for cs in ranks.values() for c in cs if c.error)
    hurt = sum(1 for cs in ranks.values() for c in cs if c.damage)
    extra = [f"{bad} unreadable sidecar{'s' if bad != 1 else ''}"] * bool(bad) + \
        [f"{hurt} damaged cop{'ies' if hurt != 1 else 'y'}"] * bool(hurt)
    return True, f"complete ({', '.join(extra)})" if extra else "complete"


def table(inv: Inventory, any_shared: bool) -> Table:
    """One row per step; the "shared" column only when some copy is shared. Fits an
    80-column terminal: no vertical rules, figures never cut, words wrap whole (a long job
    name folds), nothing ends in "..."."""
    rows = []
    partial = inv.partial_views()
    for (job, step), ranks in inv.steps().items():
        w, _ = world_size(ranks)
        present = sum(1 for cs in ranks.values() if any(c.sidecar and not c.damage for c in cs))  # usable
        copies = [c for cs in ranks.values() for c in cs]
        nodes = sorted({c.holder for c in copies if c.tier != "persistent"})
        tiers = sorted({c.tier for c in copies}, key=["ram", "replica", "persistent"].index)
        one = sum(next((c.nbytes for c in cs if c.sidecar), 0) for cs in ranks.values())
        shared = sum(1 for c in copies if c.shared)
        complete, words = status(ranks, partial.get(job))
        rows.append({"job": job, "step": str(step), "ranks": f"{present}/{w if w is not None else '?'}",
                     "copies": str(len(copies)), "shared": str(shared), "nodes": ", ".join(nodes) or "-",
                     "tiers": ", ".join(tiers), "size": human(one), "stored": human(sum(c.stored for c in copies)),
                     "status": f"[yellow]{words}[/]" if complete is None else f"[green]{words}[/]" if complete
                     else f"[red]{words}[/]"})
    t = Table(title="incluster checkpoints", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 1, 0, 0))
    num = {"justify": "right", "no_wrap": True}
    word = {"overflow": "fold"}
    cols = [("job", word), ("step", num), ("ranks", num), ("copies", num), ("shared", num), ("nodes", word),
            ("tiers", word), ("size", num), ("stored", num), ("status", {**word, "min_width": 8})]
    cols = [c for c in cols if c[0] != "shared" or any_shared]
    for col, kw in cols:
        t.add_column(col, **kw)  # type: ignore[arg-type]
    for row in rows:
        t.add_row(*(row[col] for col, _ in cols))
    return t


def run(args: argparse.Namespace) -> int:
    out, err = consoles()
    inv = load(args, err)
    if inv is None:
        return 2
    missing = args.job is not None and args.job not in inv.jobs  # a --job that is not there: exit status 1
    if not inv.copies:
        out.print(f"no checkpoints found under {', '.join(args.dirs + args.persistent)}{inv.elsewhere(args.job)}"
                  f"{inv.rank_folders(args.dirs)}",
                  markup=False)
        missing = missing or bool(inv.rank_folders(args.dirs))  # a wrong path, not an empty one
    else:
        shared = any(c.shared for c in inv.copies)
        out.print(table(inv, shared))
        out.print("size: one copy of every rank; stored: every copy in every tier"
                  + ("; shared: replicas whose bytes are a data-parallel peer's identical shard on the same node "
                     "(stored once)" if shared else ""), style="dim")
    for c in inv.copies:
        if c.error:
            line(out, "[red]unreadable sidecar:[/]", c.error)
        elif c.damage:
            line(out, "[red]damaged copy:[/]", c.damage)
    for _, _, text in inv.problems:
        line(out, "[red]problem:[/]", text)
    for n in inv.notes:
        line(out, "[dim]info:[/]", f"{n.path}: {n.what}")
    for job, unseen in sorted(inv.partial_views().items()):
        line(out, "[dim]info:[/]", f"job {job}: no folder listed holds rank(s) {ranges(unseen)}; list every node's "
                                   f"folder (or --persistent) to see which steps are complete")
    return 1 if missing else 0
