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
    return "nothing"


def render(con: Any, phases: list[dict[str, Any]], whatif: dict[str, Any], run_dir: str,
           args: argparse.Namespace, persistent: str) -> None:
    from rich.table import Table

    step_s = phases[0]["reports"].get(0, {}).get("step_s") or phases[0]["seconds"] / max(1, phases[0].get("progress", 1) + 1)
    for i in range(1, len(phases)):
        before, after = phases[i - 1], phases[i]
        reps = after["reports"]
        table = Table(title=f"Recovery {i}: node {before['victim']} lost at step {before['progress']}; "
                            f"layout now {' '.join(after['layout'])}")
        for col in ("rank", "node", "restored step", "from", "MB", "seconds", "bitwise"):
            table.add_column(col, justify="right" if col in ("rank", "restored step", "MB", "seconds") else "left")
        per_source: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        all_same = True
        for r in sorted(reps):
            rep = reps[r]
            step = rep.get("restored")
            saved = before["reports"].get(r, {}).get("saved", {}).get(str(step))
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
        step = reps[0].get("restored")
        lost = before["progress"] - (step if step is not None else -1)
        for src, (nbytes, secs) in sorted(per_source.items()):
            con.print(f"  {src}: {nbytes / 1e6:.1f} MB, slowest rank {secs:.3f} s")
        con.print(f"  steps lost: {lost} (progress {before['progress']} -> restored {step}), "
                  f"about {lost * step_s:.1f} s of training at {step_s:.2f} s/step")
        if step is not None:
            nxt = str(step + 1)
            l1 = before["reports"].get(0, {}).get("losses", {}).get(nxt)
            l2 = after["reports"].get(0, {}).get("losses", {}).get(nxt)
            if l1 is not None and l2 is not None:
                verdict = "identical" if l1 == l2 else "DIFFERENT"
                after["loss_same"] = l1 == l2
                con.print(f"  loss at step {nxt}: {l1} before the failure, {l2} after recovery ({verdict})")
            else:
                con.print(f"  the failure came right after step {step}'s checkpoint: no step is trained twice")
        con.print(f"  restored state checksum matches the saved one on every rank: "
                  f"{'[green]yes[/]' if all_same else '[red]NO[/]'}")
    _whatif(con, phases, whatif, args, step_s)
    _goodput(con, run_dir, args)


def _whatif(con: Any, phases: list[dict[str, Any]], whatif: dict[str, Any], args: argparse.Namespace, step_s: float) -> None:
    if len(phases) < 2 or not whatif:
        return
    if whatif.get("failed"):
        con.print(f"[red]the persistent-tier what-if restore failed[/] {whatif.get('log', '')}")
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
    except Exception as exc:  # noqa: BLE001 - the report is extra; the demo's verdict stands
        con.print(f"(goodput report unavailable: {exc})")
    try:
        from incluster.goodput.plot import plot_timeline

        plot_timeline(run_dir, args.timeline)
        con.print(f"timeline written to {args.timeline}")
    except Exception as exc:  # noqa: BLE001 - matplotlib is an optional extra
        con.print(f"(timeline not written: {exc})")
