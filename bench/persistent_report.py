"""``bench/persistent.py``'s summary (per run, and the runs of each configuration pooled),
its printed table and the observations under it."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from _common import markdown_table, median  # noqa: E402 - bench/ is not a package
from persistent_worker import CONFIGS

MiB = 1 << 20


def summarize(res: dict[str, Any], save_every: int) -> dict[str, Any]:
    steps = res["steps"]
    times = [s["total_s"] for s in steps]
    saves = res["saves"]
    blocked = [(s["save_call_s"] or 0.0) + (s["stage_wait_s"] or 0.0) for s in saves]
    due = [s for s in saves if s.get("due")]
    persisted = [s for s in due if s.get("persisted") is True]
    skipped = [s for s in due if s.get("persisted") is False]
    failed = [s for s in due if isinstance(s.get("persisted"), str)]
    nbytes = res.get("shard_bytes")
    rates = []
    if nbytes:
        for s in persisted:
            start = s.get("durable_s") if res["config"].startswith("incluster") else s.get("staged_s")
            if s.get("persisted_s") is not None and start is not None and s["persisted_s"] > start:
                rates.append(nbytes / (s["persisted_s"] - start))
    return {
        "steps": len(times),
        "mean_s": statistics.fmean(times),
        "p50_s": statistics.median(times),
        "max_s": max(times),
        "saves": len(saves),
        "persistent_due": len(due),
        "persistent_ok": len(persisted),
        "persistent_skipped": len(skipped),
        "persistent_failed": len(failed),
        "blocked_median_s": median(blocked),
        "blocked_max_s": max(blocked) if blocked else None,
        "blocked_first_s": blocked[0] if blocked else None,
        "save_call_median_s": median([s["save_call_s"] for s in saves]),
        "stage_wait_median_s": median([s["stage_wait_s"] for s in saves]),
        "persisted_median_s": median([s["persisted_s"] for s in persisted]),
        "persisted_max_s": max((s["persisted_s"] for s in persisted), default=None),
        "upload_Bps_median": median(rates),
        "drain_s": res["drain_s"],
    }


def _f(x: float | None, scale: float = 1e3, digits: int = 0) -> str:
    return "—" if x is None else f"{x * scale:.{digits}f}"


def _pct(x: float | None, base: float | None) -> str:
    return "—" if x is None or not base else f"{(x / base - 1) * 100:+.1f}%"


def _load(r: dict[str, Any]) -> str:
    a, b = r.get("load_before"), r.get("load_after")
    return "—" if a is None else f"{a:.1f}-{b:.1f}" if b is not None else f"{a:.1f}"


def print_report(results: list[dict[str, Any]], configs: list[str], tput: dict[str, Any] | None,
                 args: argparse.Namespace, others: list[str]) -> tuple[list[dict[str, Any]], float | None]:
    """The table (one row per configuration, its runs pooled, then the upload-alone rows)
    and the observations under it. Returns the pooled rows and the no-checkpointing mean
    step time (both 'none' runs pooled)."""
    k = args.save_every
    nones = [r["summary"] for r in results if r["config"] == "none" and "summary" in r]
    base = statistics.fmean([t for r in results if r["config"] == "none" and "summary" in r
                             for t in (s["total_s"] for s in r["steps"])]) if nones else None
    base_p50 = statistics.median([t for r in results if r["config"] == "none" and "summary" in r
                                  for t in (s["total_s"] for s in r["steps"])]) if nones else None
    pooled = pool(results, configs, k)
    headers = ["configuration", "saves (persistent ok/due, skipped)", "mean step ms", "inflation", "p50 infl.",
               "max step ms",
               "trainer blocked/save ms: median", "max", "first", "persisted after s: median", "max",
               "upload MiB/s", "load"]
    rows: list[list[str]] = []
    for r in pooled:
        label = r["note"] + (f" ({r['runs']} runs)" if r["runs"] > 1 else "")
        if r.get("error"):
            rows.append([label, "FAILED", r["error"].splitlines()[0][:50]] + [""] * (len(headers) - 3))
            continue
        s = r["summary"]
        pers = (f"{s['saves']} ({s['persistent_ok']}/{s['persistent_due']}, {s['persistent_skipped']})"
                if s["persistent_due"] else (f"{s['saves']}" if s["saves"] else "—"))
        rows.append([label, pers, _f(s["mean_s"]), _pct(s["mean_s"], base) if r["config"] != "none" else "",
                     _pct(s["p50_s"], base_p50) if r["config"] != "none" else "", _f(s["max_s"]),
                     _f(s["blocked_median_s"], digits=1), _f(s["blocked_max_s"], digits=1),
                     _f(s["blocked_first_s"], digits=1), _f(s["persisted_median_s"], 1, 2),
                     _f(s["persisted_max_s"], 1, 2),
                     _f(s["upload_Bps_median"], 1 / MiB, 0), _load(r)])
    if tput is not None:
        mb = tput["bytes"] / MiB
        rows.append([f"upload alone: FsspecTier.write, mapped shard ({mb:.0f} MiB)", "", "", "", "", "", "", "", "",
                     _f(tput["incluster_median_s"], 1, 2), _f(max(tput["incluster_s"]), 1, 2),
                     _f(tput["incluster_Bps"], 1 / MiB, 0), f"{tput['load_before']:.1f}-{tput['load_after']:.1f}"])
        rows.append([f"upload alone: copyfile + fsync ({mb:.0f} MiB)", "", "", "", "", "", "", "", "",
                     _f(tput["plain_median_s"], 1, 2), _f(max(tput["plain_s"]), 1, 2),
                     _f(tput["plain_Bps"], 1 / MiB, 0), ""])
    print()
    print(f"Per configuration: {args.steps} measured steps; inflation of the mean step time against no checkpointing "
          f"(both 'none' runs pooled: {_f(base)} ms; p50 infl.: of the median step); trainer blocked per save = "
          f"the save call (+ DCP's wait for its "
          f"previous save) + the staging wait before the next optimizer.step(); persisted after = from the save call "
          f"until the step is in the persistent target (incluster: in its manifest; DCP: upload_completion); upload "
          f"MiB/s = shard bytes / (persisted - durable in RAM) for incluster, / (persisted - staged) for DCP, median; "
          f"'upload alone' rows: the same bytes written alone after training, median of {args.repeats} (persisted "
          f"after = seconds per write); load = 1-minute load average before-after.")
    print()
    print(markdown_table(headers, rows, right=[False] + [True] * (len(headers) - 1)))
    print()
    for line in observations(results, pooled, base, tput, args, others):
        print(f"- {line}")
    return pooled, base


def pool(results: list[dict[str, Any]], configs: list[str], save_every: int) -> list[dict[str, Any]]:
    """One row per configuration: the steps and saves of all its successful runs pooled."""
    out = []
    for kind in configs:
        runs = [r for r in results if r["config"] == kind]
        ok = [r for r in runs if "summary" in r]
        row: dict[str, Any] = {"config": kind, "note": CONFIGS[kind], "runs": len(ok),
                               "load_before": min((r["load_before"] for r in runs if r.get("load_before") is not None),
                                                  default=None),
                               "load_after": max((r["load_after"] for r in runs if r.get("load_after") is not None),
                                                 default=None)}
        if not ok:
            row["error"] = runs[0].get("error") if runs else "not run"
            out.append(row)
            continue
        merged = {"config": kind, "steps": [s for r in ok for s in r["steps"]],
                  "saves": [s for r in ok for s in r["saves"]], "drain_s": max(r["drain_s"] for r in ok),
                  "shard_bytes": next((r["shard_bytes"] for r in ok if r.get("shard_bytes")), None)}
        row["summary"] = summarize(merged, save_every)
        row["summary"]["blocked_first_s"] = max(r["summary"]["blocked_first_s"] or 0.0 for r in ok) or None
        if len(ok) < len(runs):
            row["errors"] = [r["error"] for r in runs if r.get("error")]
        out.append(row)
    return out


def observations(results: list[dict[str, Any]], pooled: list[dict[str, Any]], base: float | None,
                 tput: dict[str, Any] | None, args: argparse.Namespace, others: list[str]) -> list[str]:
    by = {r["config"]: r["summary"] for r in pooled if "summary" in r}
    out = []
    loads = [x for r in results for x in (r.get("load_before"), r.get("load_after")) if x is not None]
    cpus = os.cpu_count() or 1
    if loads:
        busy = f" ({', '.join(others)})" if others else ""
        out.append(f"load average {min(loads):.1f}-{max(loads):.1f} on {cpus} CPUs during the run"
                   + (f"; other work was running at the same time{busy}, so absolute times are noisy and "
                      f"inflation figures carry that noise" if others or max(loads) > cpus else ""))
    nones = [r["summary"]["mean_s"] for r in results if r["config"] == "none" and "summary" in r]
    if len(nones) >= 2:
        out.append(f"no-checkpointing mean step over the run's {len(nones)} 'none' runs: "
                   f"{' -> '.join(f'{x * 1e3:.0f}' for x in nones)} ms (spread {(max(nones) / min(nones) - 1) * 100:.0f}%); "
                   f"inflations smaller than that spread are within noise")
    for kind in by:
        per = [r["summary"]["mean_s"] for r in results if r["config"] == kind and "summary" in r]
        if len(per) > 1 and kind != "none":
            out.append(f"{kind} per run: {', '.join(f'{x * 1e3:.0f}' for x in per)} ms mean step")
    ip, ir = by.get("incluster.persist"), by.get("incluster.ram")
    if ip and base:
        out.append(f"incluster with persistent saves: {(ip['mean_s'] / base - 1) * 100:+.1f}% mean step time, the "
                   f"trainer blocked {_f(ip['blocked_median_s'], digits=1)} ms per save (median, max "
                   f"{_f(ip['blocked_max_s'], digits=1)} ms) for {ip['saves']} saves, {ip['persistent_ok']} of "
                   f"{ip['persistent_due']} persistent ones in the manifest after {_f(ip['persisted_median_s'], 1, 2)} s "
                   f"(median)" + (f"; {ip['persistent_skipped']} skipped because the previous upload was still running"
                                  if ip["persistent_skipped"] else ""))
        if ir:
            out.append(f"the uploads' own cost: incluster.persist {ip['mean_s'] * 1e3:.0f} ms vs incluster.ram "
                       f"{ir['mean_s'] * 1e3:.0f} ms mean step ({(ip['mean_s'] / ir['mean_s'] - 1) * 100:+.1f}%)")
    for kind in ("dcp.thread", "dcp.process"):
        d = by.get(kind)
        if d and base:
            out.append(f"{kind}: {(d['mean_s'] / base - 1) * 100:+.1f}% mean step time for {d['saves']} saves (every "
                       f"{args.save_every * args.every} steps), blocked {_f(d['blocked_median_s'], digits=1)} ms per save "
                       f"(median, max {_f(d['blocked_max_s'], digits=1)} ms), persisted after "
                       f"{_f(d['persisted_median_s'], 1, 2)} s (median)")
    dk = min((k_ for k_ in ("dcp.thread", "dcp.process") if k_ in by), key=lambda k_: by[k_]["blocked_median_s"],
             default=None)
    if ip and dk:
        dbest = by[dk]
        out.append(f"per save, incluster blocks the trainer {_f(ip['blocked_median_s'], digits=1)} ms (median; "
                   f"max {_f(ip['blocked_max_s'], digits=1)} ms) against {_f(dbest['blocked_median_s'], digits=1)} "
                   f"ms for DCP's least-blocking configuration ({dk}; max {_f(dbest['blocked_max_s'], digits=1)} ms), "
                   f"while also saving to RAM {args.every}x as often; time until persisted: "
                   f"{_f(ip['persisted_median_s'], 1, 2)} s vs {_f(dbest['persisted_median_s'], 1, 2)} s (medians)")
    if tput:
        out.append(f"upload alone ({tput['bytes'] / MiB:.0f} MiB): incluster's FsspecTier.write "
                   f"{tput['incluster_Bps'] / MiB:.0f} MiB/s vs copyfile+fsync {tput['plain_Bps'] / MiB:.0f} MiB/s: "
                   f"ratio {tput['incluster_Bps'] / tput['plain_Bps']:.2f} (1.00 = as fast as a plain copy; best runs "
                   f"{tput['incluster_best_Bps'] / MiB:.0f} vs {tput['plain_best_Bps'] / MiB:.0f} MiB/s); per-run "
                   f"seconds incluster {[round(x, 2) for x in tput['incluster_s']]}, plain "
                   f"{[round(x, 2) for x in tput['plain_s']]}")
        if ip and ip["upload_Bps_median"]:
            out.append(f"during training the upload ran at {ip['upload_Bps_median'] / MiB:.0f} MiB/s (median), "
                       f"{ip['upload_Bps_median'] / tput['plain_Bps']:.2f}x the plain copy alone: it shares the CPUs "
                       f"and the disk with training (and includes sidecar, manifest and retention)")
    return out
