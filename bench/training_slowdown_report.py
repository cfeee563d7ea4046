"""``bench/training_slowdown.py``'s summary (per-step times of the slower rank, the steady
and within-run estimates, per-save medians; runs of a configuration pooled) and its
printed tables."""

from __future__ import annotations

import statistics
from typing import Any

from _common import markdown_table  # noqa: E402 - bench/ is not a package


def summarize(res: dict[str, Any], every: int) -> dict[str, Any]:
    """Per-step time of the job = the slowest rank's time for that step."""
    ranks = res["ranks"]
    n = len(ranks[0]["steps"])
    per_step = [max(r["steps"][i]["total_s"] for r in ranks) for i in range(n)]
    r0 = ranks[0]["steps"]
    saved_idx = [i for i in range(n) if r0[i]["saved"]]
    after_idx = [i for i in range(n) if i > 0 and r0[i - 1]["saved"]]
    steady = per_step[every:] if n > every else per_step

    def mean_of(key: str, idx: list[int] | None = None) -> float | None:
        idx = list(range(n)) if idx is None else idx
        vals = [r["steps"][i][key] for r in ranks for i in idx]
        return statistics.fmean(vals) if vals else None

    def med(vals: list[Any]) -> float | None:
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    save_m = statistics.fmean([per_step[i] for i in saved_idx]) if saved_idx else None
    after_m = statistics.fmean([per_step[i] for i in after_idx]) if after_idx else None
    rest = [per_step[i] for i in range(n) if i not in saved_idx and i not in after_idx]
    other_m = statistics.fmean(rest) if rest else None
    # Within one run, robust to load that drifts between runs: the extra time of the
    # saving step and the step after it (where the background copy runs) over the other
    # steps of the same run, spread over the save interval.
    excess = (save_m - other_m) + (after_m - other_m) if None not in (save_m, after_m, other_m) else None
    # The same from the second save on: what every save costs once the one-time work
    # (slot files, staging buffers, a checkpoint process) is done.
    later = [i for i in saved_idx[1:]]
    later_after = [i + 1 for i in later if i + 1 < n]
    steady_excess = (
        statistics.fmean([per_step[i] for i in later]) - other_m + statistics.fmean([per_step[i] for i in later_after]) - other_m
        if later and later_after and other_m else None
    )
    saves = [s for r in ranks for s in r["saves"]]
    steady_saves = [s for r in ranks for s in r["saves"][1:]] or saves
    return {
        "steps": n,
        "step_times_s": per_step,
        "mean_s": statistics.fmean(per_step),
        "p50_s": statistics.median(per_step),
        "max_s": max(per_step),
        "steady_mean_s": statistics.fmean(steady),
        "save_step_mean_s": save_m,
        "after_save_mean_s": after_m,
        "other_step_mean_s": other_m,
        "excess_per_save_s": excess,
        "within_run_inflation": excess / (every * other_m) if excess is not None and other_m else None,
        "steady_within_run_inflation": steady_excess / (every * other_m) if steady_excess is not None and other_m else None,
        "fwd_bwd_mean_s": mean_of("fwd_bwd_s"),
        "optim_mean_s": mean_of("optim_s"),
        "stage_wait_mean_s": mean_of("stage_wait_s"),
        "saves": len(saves) // max(1, len(ranks)),
        "blocked_median_s": med([s["blocked_s"] for s in saves]),
        "blocked_first_s": med([r["saves"][0]["blocked_s"] for r in ranks if r["saves"]]),
        "staged_median_s": med([s.get("staged_s") for s in steady_saves]),
        "durable_median_s": med([s.get("durable_s") for s in steady_saves]),
        "wait_prev_median_s": med([s.get("wait_prev_s") for s in saves]),
        "drain_s": max(r["drain_s"] for r in ranks),
        "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks),
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs (rounds) pooled: step-time statistics over every step of
    every run; per-save medians over every save; memory and drain: the worst run."""
    sums = [r["summary"] for r in runs]
    if len(sums) == 1:
        return dict(sums[0], runs=1)
    pooled = [t for s in sums for t in s["step_times_s"]]

    def fmean(key: str) -> float | None:
        vals = [s[key] for s in sums if s[key] is not None]
        return statistics.fmean(vals) if vals else None

    def med(key: str) -> float | None:
        vals = [s[key] for s in sums if s[key] is not None]
        return statistics.median(vals) if vals else None

    out = {k: fmean(k) for k in ("steady_mean_s", "save_step_mean_s", "after_save_mean_s", "other_step_mean_s",
                                 "fwd_bwd_mean_s", "optim_mean_s", "stage_wait_mean_s", "excess_per_save_s",
                                 "within_run_inflation", "steady_within_run_inflation")}
    out.update({k: med(k) for k in ("blocked_median_s", "blocked_first_s", "staged_median_s", "durable_median_s",
                                    "wait_prev_median_s")})
    out.update(runs=len(sums), steps=len(pooled), step_times_s=pooled, mean_s=statistics.fmean(pooled),
               p50_s=statistics.median(pooled), max_s=max(pooled), saves=sum(s["saves"] for s in sums),
               drain_s=max(s["drain_s"] for s in sums), max_rss_bytes=max(s["max_rss_bytes"] for s in sums),
               per_run_mean_s=[s["mean_s"] for s in sums])
    return out


def fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def fmt_pct(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "—"
    return f"{(x / base - 1) * 100:+.1f}%"


def print_tables(rows_in: list[dict[str, Any]], base: dict[str, Any] | None) -> None:
    """``rows_in``: one entry per configuration, {config, label, summary | error, load}."""
    base_mean = base["mean_s"] if base else None
    base_steady = base["steady_mean_s"] if base else None
    base_p50 = base["p50_s"] if base else None
    results = rows_in
    headers = ["configuration", "mean", "p50", "max", "inflation", "steady mean", "steady infl.", "p50 infl.",
               "within-run est.", "steady within-run", "save() blocks (median)", "staged", "durable", "load"]
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([r["note"], "FAILED", r["error"].splitlines()[0][:60]] + [""] * (len(headers) - 3))
            continue
        s = r["summary"]
        rows.append([
            r["label"], fmt_ms(s["mean_s"]), fmt_ms(s["p50_s"]), fmt_ms(s["max_s"]), fmt_pct(s["mean_s"], base_mean),
            fmt_ms(s["steady_mean_s"]), fmt_pct(s["steady_mean_s"], base_steady), fmt_pct(s["p50_s"], base_p50),
            f"{s['within_run_inflation'] * 100:+.1f}%" if s.get("within_run_inflation") is not None else "—",
            f"{s['steady_within_run_inflation'] * 100:+.1f}%" if s.get("steady_within_run_inflation") is not None else "—",
            f"{s['blocked_median_s'] * 1e3:.1f}" if s["blocked_median_s"] is not None else "—",
            fmt_ms(s["staged_median_s"]), fmt_ms(s["durable_median_s"]),
            r.get("load", "—"),
        ])
    print(markdown_table(headers, rows, right=[False] + [True] * (len(headers) - 1)))
    print()
    headers = ["configuration", "save step", "step after save", "other steps", "fwd+bwd", "optim.step",
               "DCP staging wait", "first save() blocks", "wait prev save", "drain at end", "peak RSS/rank",
               "job memory peak"]
    rows = []
    for r in results:
        if r.get("error"):
            continue
        s = r["summary"]
        rows.append([
            r["label"], fmt_ms(s["save_step_mean_s"]), fmt_ms(s["after_save_mean_s"]), fmt_ms(s["other_step_mean_s"]),
            fmt_ms(s["fwd_bwd_mean_s"]), fmt_ms(s["optim_mean_s"]),
            fmt_ms(s["stage_wait_mean_s"]) if r["config"].startswith("dcp") else "—",
            f"{s['blocked_first_s'] * 1e3:.1f}" if s["blocked_first_s"] is not None else "—",
            fmt_ms(s["wait_prev_median_s"]) if r["config"].startswith("dcp") else "—",
            fmt_ms(s["drain_s"]), f"{s['max_rss_bytes'] / 2**30:.2f} GiB",
            f"{r.get('job_mem_peak_bytes', 0) / 2**30:.2f} GiB",
        ])
    print(markdown_table(headers, rows, right=[False] + [True] * (len(headers) - 1)))
