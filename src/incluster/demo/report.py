"""The demo's closing report: where each rank's state came from, bytes and seconds per
source, steps lost, bitwise and loss checks, goodput, and the persistent-only what-if."""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any


def _source(rep: dict[str, Any]) -> str:
    r = rep.get("restore") or {}
    if r.get("source") == "local":
        return "own node's RAM"
    if r.get("source") == "peer":
        return f"peer RAM: rank {r.get('source_rank')} on node {r.get('source_node')}"
    if r.get("source") == "persistent":
        return "persistent tier"
    if r.get("source") == "reshard":
        fetched = any("persistent tier" in n for n in r.get("notes") or ())
        return "persistent tier, resharded" if fetched else "surviving nodes' RAM, resharded"
    return "nothing"


def _saved(earlier: list[dict[str, Any]], step: Any, rank: int) -> str | None:
    """The digest of ``step`` as saved by the newest earlier phase that saved it. The
    digests are of the whole state (sharded values gathered), so any world size compares."""
    for p in reversed(earlier):
        got = p["reports"].get(rank % max(1, p.get("world", 1)), {}).get("saved", {}).get(str(step))
        if got is not None:
            return str(got)
    return None


def _loss(earlier: list[dict[str, Any]], step: int) -> Any:
    """Rank 0's loss at ``step`` in the newest earlier phase that trained it (its batch
    does not depend on the world size)."""
    for p in reversed(earlier):
        got = p["reports"].get(0, {}).get("losses", {}).get(str(step))
        if got is not None:
            return got
    return None


def render(con: Any, phases: list[dict[str, Any]], whatif: dict[str, Any], run_dir: str,
           args: argparse.Namespace, persistent: str) -> None:
    from rich.table import Table

    step_s = phases[0]["reports"].get(0, {}).get("step_s") or phases[0]["seconds"] / max(1, phases[0].get("progress", 1) + 1)
    for i in range(1, len(phases)):
        before, after = phases[i - 1], phases[i]
        reps = after["reports"]
        old_world, new_world = before.get("world", len(before["reports"])), after.get("world", len(reps))
        elastic = old_world != new_world
        now = (f"no spare: {old_world} -> {new_world} ranks on {' '.join(after['layout'])}" if elastic
               else f"layout now {' '.join(after['layout'])}")
        table = Table(title=f"Recovery {i}: node {before['victim']} lost at step {before['progress']}; {now}")
        for col in ("rank", "node", "restored step", "from", "MB", "seconds", "bitwise"):
            table.add_column(col, justify="right" if col in ("rank", "restored step", "MB", "seconds") else "left")
        per_source: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        all_same = True
        for r in sorted(reps):
            rep = reps[r]
            step = rep.get("restored")
            saved = _saved(phases[:i], step, r)
            same = saved is not None and saved == rep.get("restored_digest")
            all_same &= same
            restore = rep.get("restore") or {}
            src = _source(rep)
            per_source[src.split(":")[0]][0] += restore.get("bytes", 0)
            per_source[src.split(":")[0]][1] = max(per_source[src.split(":")[0]][1], restore.get("seconds", 0.0))
            table.add_row(str(r), rep.get("node", "?"), str(step), src, f"{restore.get('bytes', 0) / 1e6:.1f}",
                          f"{restore.get('seconds', 0.0):.3f}", "[green]yes[/]" if same else "[red]NO[/]")
        after["bitwise"] = all_same
        con.print(table)
        if elastic:
            after["resharded"] = bool(reps) and all((rep.get("restore") or {}).get("source") == "reshard" for rep in reps.values())
            for note in (reps.get(0, {}).get("restore") or {}).get("notes", []):
                con.print(f"  rank 0: {note}")
        step = reps[0].get("restored")
        lost = before["progress"] - (step if step is not None else -1)
        for src, (nbytes, secs) in sorted(per_source.items()):
            con.print(f"  {src}: {nbytes / 1e6:.1f} MB, slowest rank {secs:.3f} s")
        con.print(f"  steps lost: {lost} (progress {before['progress']} -> restored {step}), "
                  f"about {lost * step_s:.1f} s of training at {step_s:.2f} s/step")
        if step is not None:
            nxt = step + 1
            l1, l2 = _loss(phases[:i], nxt), after["reports"].get(0, {}).get("losses", {}).get(str(nxt))
            if l1 is not None and l2 is not None:
                verdict = "identical" if l1 == l2 else "DIFFERENT"
                after["loss_same"] = l1 == l2
                con.print(f"  loss at step {nxt}: {l1} before the failure, {l2} after recovery ({verdict})")
            else:
                con.print(f"  the failure came right after step {step}'s checkpoint: no step is trained twice")
        if elastic:
            whole = "every shard gathered" if args.parallel == "fsdp" else "each rank's full replica"
            saved_by = (reps.get(0, {}).get("restore") or {}).get("old_world") or old_world
            con.print(f"  the whole restored state ({whole}) on {new_world} ranks is bitwise the one "
                      f"{saved_by} ranks saved: {'[green]yes[/]' if all_same else '[red]NO[/]'}")
            _went_on(con, before, after, new_world)
        else:
            con.print(f"  restored state checksum matches the saved one on every rank: "
                      f"{'[green]yes[/]' if all_same else '[red]NO[/]'}")
    _whatif(con, phases, whatif, args, step_s)
    _goodput(con, run_dir, args)
    gone = sorted(range(phases[-1].get("world", 0), max(p.get("world", 0) for p in phases)))
    if gone:
        lost = [(p.get("victim"), [r for r, n in enumerate(p.get("layout") or []) if n == p.get("victim")])
                for p in phases[:-1] if p.get("victim")]
        said = "; ".join(f"node {v} (rank(s) {', '.join(map(str, rs))}) was lost" for v, rs in lost)
        con.print(f"  ({said}; the job went on with {phases[-1].get('world')} ranks, numbered anew: in the goodput "
                  f"above, rank number(s) {', '.join(map(str, gone))} have no attempt after the restart, and their "
                  f"share of the time from then on counts as 'other')")


def _went_on(con: Any, before: dict[str, Any], after: dict[str, Any], world: int) -> None:
    """Training after an elastic restart: rank 0's loss from the first step trained again to the last."""
    losses = {int(k): v for k, v in after["reports"].get(0, {}).get("losses", {}).items()}
    if not losses:
        con.print("  [red]no step was trained after the restore[/]")
        return
    first, last = min(losses), max(losses)
    con.print(f"  training went on with {world} ranks: rank 0's loss {losses[first]} at step {first} -> "
              f"{losses[last]} at step {last} (after step {first} the global batch is {world}/{before.get('world')} "
              f"of the old one, so the losses no longer match the old run's)")


def _whatif(con: Any, phases: list[dict[str, Any]], whatif: dict[str, Any], args: argparse.Namespace, step_s: float) -> None:
    if len(phases) < 2 or not whatif:
        return
    if whatif.get("failed"):
        con.print("[red]the persistent-tier what-if restore failed[/]")
        con.print(whatif.get("log", ""), markup=False, highlight=False)
        return
    reps = whatif["reports"]
    p_step = reps[0].get("restored")
    p_secs = max((r.get("restore") or {}).get("seconds", 0.0) for r in reps.values())
    first = phases[0]
    in_cluster = phases[1]["reports"]
    c_step = in_cluster[0].get("restored")
    c_secs = max((r.get("restore") or {}).get("seconds", 0.0) for r in in_cluster.values())
    lost_c = first["progress"] - (c_step if c_step is not None else -1)
    lost_p = first["progress"] - (p_step if p_step is not None else -1)
    con.print(
        f"[bold]Same failure, persistent tier only[/] ({args.persistent_bandwidth:.0f} MB/s): restores step "
        f"{p_step} in {p_secs:.2f} s and loses {lost_p} steps -> {p_secs + lost_p * step_s:.1f} s of badput, "
        f"against {c_secs + lost_c * step_s:.1f} s from the cluster's RAM ({c_secs:.2f} s restore, {lost_c} steps lost)"
    )


def _goodput(con: Any, run_dir: str, args: argparse.Namespace) -> None:
    try:
        from incluster.goodput.report import build_report, render

        render(build_report(run_dir), con)
        con.print("lost progress above runs to the last event a killed process wrote (at most 0.5 s before the "
                  "kill: the recorder writes twice a second; the rest is in restart) and counts a step begun but not "
                  "finished, so it differs a little from the whole steps the recovery table counts", style="dim")
    except Exception as exc:  # noqa: BLE001 - the report is extra; the demo's verdict stands
        con.print(f"(goodput report unavailable: {exc})")
    try:
        from incluster.goodput.plot import plot_timeline

        plot_timeline(run_dir, args.timeline)
        con.print(f"timeline written to {args.timeline}")
    except Exception as exc:  # noqa: BLE001 - matplotlib is an optional extra
        con.print(f"(timeline not written: {exc})")
