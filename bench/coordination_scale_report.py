"""``bench/coordination_scale.py``'s summary (per world size and system: medians over the
measured saves of rank 0's and the busiest other rank's traffic, calls and times) and its
printed tables."""

from __future__ import annotations

from typing import Any

from _common import markdown_table, median  # noqa: E402 - bench/ is not a package
from coordination_scale_ranks import DCP_SYSTEMS

LABELS = {
    "incluster-thread": "incluster (thread writer)",
    "incluster-process": "incluster (process writer)",
    "incluster-thread+replica": "incluster (thread, 1 replica)",
    "dcp.save": "dcp.save",
    "dcp.save+cache": "dcp.save +plan cache",
    "dcp.async_save": "dcp.async_save",
    "dcp.async_save+cache": "dcp.async_save +plan cache",
}


def summarise(world_result: dict[str, Any], systems: list[str], warmup: int) -> list[dict[str, Any]]:
    ranks = sorted(world_result["ranks"], key=lambda r: r["rank"])
    world = world_result["world"]
    rows = []
    for system in systems:
        per_rank = [r["systems"].get(system) for r in ranks]
        if any(s is None for s in per_rank):
            errs = {r["rank"]: r["errors"].get(system) for r in ranks if r["errors"].get(system)}
            rows.append({"world": world, "system": system, "error": errs or "did not run"})
            continue
        n = len(per_rank[0])
        saves = range(warmup, n)

        def rank0(step: int, what: str) -> int:
            # the store's server side already holds rank 0's own store requests
            w = per_rank[0][step]["wire"]
            return w["server"][what] + w["gloo"][what]

        def own(r: int, step: int, what: str) -> int:
            w = per_rank[r][step]["wire"]
            return w["client"][what] + w["gloo"][what]

        def busiest_other(step: int, what: str) -> int:
            vals = [own(r, step, what) for r in range(1, world)]
            return max(vals) if vals else 0

        counted = per_rank[0][0]["calls_counted"]
        is_dcp = system in DCP_SYSTEMS

        def ops(step: int) -> int:
            key = "object_colls" if is_dcp else "store_ops"
            return max(per_rank[r][step]["calls"][key] for r in range(world))

        row = {
            "world": world,
            "system": system,
            "saves": len(saves),
            "rank0_msgs": median([rank0(s, "msgs") for s in saves]),
            "rank0_bytes": median([rank0(s, "bytes") for s in saves]),
            "rank0_store_msgs": median([per_rank[0][s]["wire"]["server"]["msgs"] for s in saves]),
            "rank0_gloo_msgs": median([per_rank[0][s]["wire"]["gloo"]["msgs"] for s in saves]),
            "rank0_store_conns": per_rank[0][-1]["wire"]["server"].get("conns"),
            "rank_gloo_conns": per_rank[-1][-1]["wire"]["gloo"].get("conns"),
            "rank_store_conns": per_rank[-1][-1]["wire"]["client"].get("conns"),
            "rank0_store_bytes": median([per_rank[0][s]["wire"]["server"]["bytes"] for s in saves]),
            "rank0_gloo_bytes": median([per_rank[0][s]["wire"]["gloo"]["bytes"] for s in saves]),
            "other_store_bytes": median([max(per_rank[r][s]["wire"]["client"]["bytes"] for r in range(1, world)) for s in saves]),
            "other_gloo_bytes": median([max(per_rank[r][s]["wire"]["gloo"]["bytes"] for r in range(1, world)) for s in saves]),
            "all_ranks_gloo_msgs": median([sum(per_rank[r][s]["wire"]["gloo"]["msgs"] for r in range(world)) for s in saves]),
            "all_ranks_gloo_bytes": median([sum(per_rank[r][s]["wire"]["gloo"]["bytes"] for r in range(world)) for s in saves]),
            "other_msgs": median([busiest_other(s, "msgs") for s in saves]),
            "other_bytes": median([busiest_other(s, "bytes") for s in saves]),
            "ops_per_rank": median([ops(s) for s in saves]) if counted else None,
            "ops_per_rank_min": min(min(per_rank[r][s]["calls"]["object_colls" if is_dcp else "store_ops"]
                                        for r in range(world)) for s in saves) if counted else None,
            "tensor_colls_per_rank": median([max(per_rank[r][s]["calls"]["tensor_colls"] for r in range(world)) for s in saves]) if is_dcp else None,
            "pickled_bytes_all_ranks": median([sum(per_rank[r][s]["calls"]["pickled_bytes"] for r in range(world)) for s in saves]) if is_dcp else None,
            "store_op_ms": (median([per_rank[r][s]["calls"]["store_op_s"] for r in range(world) for s in saves]) or 0) * 1e3 if (counted and not is_dcp) else None,
            "coord_ms_med": _ms(median([per_rank[r][s]["coord_s"] for r in range(world) for s in saves])),
            "coord_ms_max": _ms(median([max(_nz(per_rank[r][s]["coord_s"]) for r in range(world)) for s in saves])),
            "blocked_ms": _ms(median([per_rank[r][s]["blocked_s"] for r in range(world) for s in saves])),
            "durable_ms": _ms(median([max(_nz(per_rank[r][s]["durable_s"]) for r in range(world)) for s in saves])),
        }
        rows.append(row)
    return rows


def _nz(x: float | None) -> float:
    return x if x is not None else float("nan")


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _f(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:
        return "—"
    if abs(x - round(x)) < 1e-9 and digits == 0:
        return f"{int(round(x))}"
    return f"{x:.{digits}f}"


def print_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "W", "system", "msgs @rank0", "KiB @rank0", "msgs/rank", "KiB/rank", "ops/rank",
        "coord ms med", "coord ms max", "save() ms", "durable ms",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([str(r["world"]), LABELS[r["system"]], "error", "", "", "", "", "", "", "", ""])
            continue
        if r["ops_per_rank"] is None:
            ops = "—"
        elif r["system"] in DCP_SYSTEMS:
            ops = f"{_f(r['ops_per_rank'], 0)} ({_f(r['tensor_colls_per_rank'], 0)})"
        else:
            lo, hi = r["ops_per_rank_min"], r["ops_per_rank"]
            ops = f"{_f(lo, 0)}-{_f(hi, 0)}" if lo != hi else _f(hi, 0)
        body.append([
            str(r["world"]),
            LABELS[r["system"]],
            _f(r["rank0_msgs"], 0),
            _f(r["rank0_bytes"] / 1024, 1),
            _f(r["other_msgs"], 0),
            _f(r["other_bytes"] / 1024, 1),
            ops,
            _f(r["coord_ms_med"], 1),
            _f(r["coord_ms_max"], 1),
            _f(r["blocked_ms"], 2),
            _f(r["durable_ms"], 1),
        ])
    table = markdown_table(headers, body, right=[True, False] + [True] * (len(headers) - 2))
    print(table, flush=True)
    return table


def print_growth(rows: list[dict[str, Any]]) -> None:
    """Per system: how rank 0's traffic grows from the smallest to the largest world."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            by.setdefault(r["system"], []).append(r)
    lines = []
    for system, rs in by.items():
        rs.sort(key=lambda r: r["world"])
        if len(rs) < 2 or not rs[0]["rank0_bytes"]:
            continue
        a, b = rs[0], rs[-1]
        lines.append(
            f"  {LABELS[system]:<28} W {a['world']}->{b['world']} ({b['world'] / a['world']:.0f}x ranks): "
            f"rank-0 msgs {a['rank0_msgs']:.0f}->{b['rank0_msgs']:.0f} ({b['rank0_msgs'] / max(a['rank0_msgs'], 1):.1f}x), "
            f"rank-0 bytes {a['rank0_bytes'] / 1024:.1f}->{b['rank0_bytes'] / 1024:.1f} KiB "
            f"({b['rank0_bytes'] / max(a['rank0_bytes'], 1):.1f}x), "
            f"per-rank bytes {a['other_bytes'] / 1024:.1f}->{b['other_bytes'] / 1024:.1f} KiB "
            f"({b['other_bytes'] / max(a['other_bytes'], 1):.1f}x)"
        )
    if lines:
        print("\ngrowth with world size:", *lines, sep="\n", flush=True)
