"""``bench/gpu.py``'s summaries (step times, per-save medians against the copy floors),
its JSON file (rewritten after every configuration) and its printed table."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from _common import markdown_table, median, ms, ratio  # noqa: E402 - bench/ is not a package

KINDS = ("copy", "compute")
MODES = ("snapshot", "trainer-drain", "direct")
FLOORS = (  # key, row label
    ("d2h_pinned", "floor (a) D2H -> pinned host"),
    ("d2h_registered_shm", "floor (b) D2H -> registered /dev/shm"),
    ("h2d_pinned", "floor (c) H2D pinned -> live tensors"),
    ("d2d", "floor (d) D2D copy of the state"),
)


def config_name(system: str, kind: str, every: str) -> str:
    """``system``: ``incluster.snapshot``, ``incluster.direct``, ``dcp.default``, ...;
    ``every``: ``"10"`` or ``"k"``."""
    return f"{system}.{kind}.every{every}"


def step_stats(times: list[float]) -> dict[str, Any]:
    if not times:
        return {"steps": 0}
    return {
        "steps": len(times),
        "mean_s": statistics.fmean(times),
        "median_s": statistics.median(times),
        "max_s": max(times),
        "min_s": min(times),
    }


def loop_summary(times: list[float], saved: list[int], base_mean: float | None) -> dict[str, Any]:
    """Step times of a loop that saved after the optimizer step of steps ``saved``."""
    out = step_stats(times)
    if not times:
        return out
    after = [i + 1 for i in saved if i + 1 < len(times)]
    # steady: without the first save's step and the one after it (one-time costs)
    first = set(saved[:1]) | set(after[:1])
    steady = [t for i, t in enumerate(times) if i not in first]
    out["save_step_mean_s"] = statistics.fmean([times[i] for i in saved]) if saved else None
    out["after_save_mean_s"] = statistics.fmean([times[i] for i in after]) if after else None
    out["steady_mean_s"] = statistics.fmean(steady) if steady else None
    if base_mean:
        out["inflation"] = out["mean_s"] / base_mean - 1
        out["steady_inflation"] = out["steady_mean_s"] / base_mean - 1 if steady else None
    return out


def save_summary(saves: list[dict[str, Any]], floors: dict[str, Any]) -> dict[str, Any]:
    """Medians over the saves without the first; ratios to floors (b) and (a)."""
    rest = saves[1:] or saves
    out: dict[str, Any] = {"saves": len(saves)}
    for key in ("ready_s", "blocked_s", "staged_s", "drained_s", "committed_s", "durable_s", "durable_after_ready_s"):
        out[f"{key[:-2]}_median_s"] = median([s.get(key) for s in rest])
        out[f"{key[:-2]}_first_s"] = saves[0].get(key) if saves else None
        out[f"{key[:-2]}_max_s"] = max((s[key] for s in rest if s.get(key) is not None), default=None)
    for fkey, tag in (("d2h_registered_shm", "b"), ("d2h_pinned", "a")):
        f = (floors.get(fkey) or {}).get("s")
        for key in ("staged", "durable", "durable_after_ready"):
            v = out[f"{key}_median_s"]
            out[f"{key}_x_floor_{tag}"] = v / f if v is not None and f else None
    return out


def write_json(path: str, report: dict[str, Any]) -> None:
    """Written to a temporary name first: a run killed while writing keeps the last copy."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)


# -- the table ---------------------------------------------------------------------------


def _floor_cell(fl: dict[str, Any] | None) -> str:
    if not fl:
        return "—"
    if fl.get("error"):
        return "ERROR"
    return f"{ms(fl.get('s'))} ms ({fl['gbps']:.1f} GB/s)" if fl.get("gbps") else f"{ms(fl.get('s'))} ms"


def _x(v: float | None) -> str:
    return "—" if v is None else (f"{v:.4f}x" if v < 0.1 else f"{v:.2f}x")


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:+.1f}%"


def _cell(cfg: dict[str, Any] | None, what: str) -> str:
    if cfg is None:
        return "—"
    if cfg.get("skipped"):
        return "skipped"
    if cfg.get("error") and not cfg.get("saves_summary"):
        return "ERROR"
    sv, lp = cfg.get("saves_summary") or {}, cfg.get("loop") or {}
    if what == "blocked":
        return f"{ms(sv.get('blocked_median_s'), 2)} (1st {ms(sv.get('blocked_first_s'), 2)})"
    if what in ("staged", "durable", "durable_after_ready"):
        v = sv.get(f"{what}_median_s")
        if v is None:
            return "—"
        return f"{ms(v)} ({_x(sv.get(f'{what}_x_floor_b'))} b, {_x(sv.get(f'{what}_x_floor_a'))} a)"
    if what == "inflation":
        return f"{_pct(lp.get('inflation'))} / max {ms(lp.get('max_s'))}"
    if what == "after":
        return f"{ms(lp.get('save_step_mean_s'))} / {ms(lp.get('after_save_mean_s'))}"
    raise ValueError(what)


def _restore_cell(rs: dict[str, Any] | None, h2d: float | None) -> str:
    if not rs:
        return "—"
    if rs.get("error") and not rs.get("seconds"):
        return "ERROR"
    first, lo = (rs.get("seconds") or [None])[0], rs.get("min_s")
    bit = {True: "bitwise ok", False: "BITWISE MISMATCH", None: "unchecked"}[rs.get("bitwise")]
    return f"{ms(first)} ({ratio(first, h2d)} c) / {ms(lo)} ({ratio(lo, h2d)} c), {bit}"


def table(report: dict[str, Any]) -> str:
    cfgs = report.get("configs", {})
    floors = report.get("floors") or {}
    ks = report.get("every_k") or {}
    headers = ["", "incluster snapshot (writer drains)", "snapshot, trainer drains", "incluster direct",
               "dcp.async_save default"]
    rows: list[list[str]] = []
    for key, label in FLOORS:
        rows.append([label, _floor_cell(floors.get(key)), "", "", ""])
    for kind in KINDS:
        base = (report.get("baseline") or {}).get(kind) or {}
        tok = base.get("tokens", "?")
        st = base.get("stats") or {}
        cell = "ERROR" if base.get("error") else "skipped" if base.get("skipped") else (
            f"{ms(st.get('mean_s'))} / {ms(st.get('median_s'))} / {ms(st.get('max_s'))}")
        rows.append([f"[{kind} {tok} tok] no-checkpoint step mean/median/max, ms", cell, "", "", ""])
        for every in ("10", "k"):
            n = "10" if every == "10" else str(ks.get(kind, "k"))
            tag = f"[{kind}, every {n}]"
            inc = [cfgs.get(config_name(f"incluster.{m}", kind, every)) for m in MODES]
            dcp = cfgs.get(config_name("dcp.default", kind, every))
            for what, label in (
                ("blocked", "save() blocked, ms median (1st)"),
                ("staged", "staged, ms median (x floor b, a)"),
                ("durable", "durable, ms median (x floor b, a)"),
                ("durable_after_ready", "durable after the GPU reached save(), ms (x floor b, a)"),
                ("inflation", "step inflation mean / max ms"),
                ("after", "saving step / step after, mean ms"),
            ):
                rows.append([f"{tag} {label}", *(_cell(c, what) for c in inc), _cell(dcp, what)])
        act = [cfgs.get(config_name(f"incluster.{m}", kind, "10")) for m in MODES]
        rows.append([f"[{kind}] gpu_snapshot_active / prepare s",
                     *(f"{c.get('gpu_snapshot_active')} / {_sec(c.get('prepare_s'))}" if c else "—" for c in act), ""])
    h2d = (floors.get("h2d_pinned") or {}).get("s")
    rows.append(["restore: first of the process / best ms (x floor c)", "", "", _restore_cell(report.get("restore"), h2d),
                 _restore_cell(report.get("dcp_load"), h2d)])
    return markdown_table(headers, rows, right=[False, True, True, True, True])


def _sec(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def notes(report: dict[str, Any]) -> list[str]:
    out = []
    kept = (report.get("configs") or {}).get(config_name("dcp.kept", "copy", "10"))
    if kept:
        if kept.get("skipped"):
            out.append(f"dcp.async_save with a kept DefaultStager: skipped ({kept['skipped']})")
        else:
            sv, lp = kept.get("saves_summary") or {}, kept.get("loop") or {}
            out.append(f"dcp.async_save with a kept DefaultStager{kept.get('stager', '')} (copy, every 10): "
                       + (f"ERROR {kept['error'].splitlines()[0][:300]}; " if kept.get("error") else "")
                       + f"{sv.get('saves', 0)} saves, staged {ms(sv.get('staged_median_s'))} ms, durable "
                       f"{ms(sv.get('durable_median_s'))} ms, inflation {_pct(lp.get('inflation'))}")
    out += many_notes(report)
    for name, c in (report.get("configs") or {}).items():
        if "+" in name and c.get("saves_summary"):
            sv, lp = c["saves_summary"], c.get("loop") or {}
            out.append(f"{name} ({c.get('env')}): staged {_cell(c, 'staged')} ms, durable {_cell(c, 'durable')} ms, "
                       f"inflation {_cell(c, 'inflation')} ms, step after a save {ms(lp.get('after_save_mean_s'))} ms, steady inflation {_pct(lp.get('steady_inflation'))}")
    skips: dict[str, list[str]] = {}
    for name, c in (report.get("configs") or {}).items():
        if c.get("error") and not name.startswith("dcp.kept"):
            out.append(f"{name}: ERROR {c['error'].splitlines()[0][:300]}")
        if c.get("skipped") and c["skipped"] != "time budget":  # those are listed below
            skips.setdefault(c["skipped"], []).append(name)
    out += [f"skipped {', '.join(names)}: {why}" for why, names in skips.items()]
    for sect in ("floors", "restore", "dcp_load"):
        s = report.get(sect) or {}
        if s.get("error"):
            out.append(f"{sect}: ERROR {s['error'].splitlines()[0][:300]}")
    for kind in KINDS:
        b = (report.get("baseline") or {}).get(kind) or {}
        if b.get("error"):
            out.append(f"baseline {kind}: ERROR {b['error'].splitlines()[0][:300]}")
    rs = report.get("restore") or {}
    if rs.get("line"):
        out.append(f"restore: {rs['line']}")
    out += [f"skipped: {s}" for s in report.get("skipped", [])]
    return out


def many_notes(report: dict[str, Any]) -> list[str]:
    """The many-tensor runs, against that state's own floors."""
    m = report.get("many") or {}
    fl = m.get("floors") or {}
    out = []
    for mode in MODES:
        c = (report.get("configs") or {}).get(config_name(f"incluster.{mode}", "many", "10"))
        if not c or c.get("skipped") or not c.get("saves_summary"):
            continue
        sv, lp = c["saves_summary"], c.get("loop") or {}
        out.append(f"many tensors, {mode} (copy, every 10; {m.get('layers')} x Linear({m.get('hidden')}) with bias: "
                   f"{fl.get('device_tensors')} device tensors, {(fl.get('bytes') or 0) / 1e9:.2f} GB; floors "
                   f"b {_floor_cell(fl.get('d2h_registered_shm'))}, a {_floor_cell(fl.get('d2h_pinned'))}): "
                   f"blocked {ms(sv.get('blocked_median_s'), 2)} ms, staged {_cell(c, 'staged')} ms, "
                   f"durable {_cell(c, 'durable')} ms, inflation {_cell(c, 'inflation')} ms")
    return out


def render(report: dict[str, Any]) -> str:
    st = report.get("state") or {}
    m = report.get("machine") or {}
    head = (f"# GPU checkpoint bench: {st.get('layers')} x Linear({st.get('hidden')}, {st.get('hidden')}, bias=False) "
            f"fp32 + AdamW = {st.get('device_tensors')} device tensors, {st.get('bytes', 0) / 2**30:.2f} GiB; "
            f"{m.get('gpu', report.get('device'))}; torch {m.get('torch')}; {report.get('steps')} measured steps, "
            f"saves every 10 and every k (k = max(2, ceil(floor b / no-checkpoint median step)): {report.get('every_k')}); "
            f"medians over saves without the first; times in ms from save(); floors: median of 3; "
            f"elapsed {report.get('elapsed_s', 0):.0f} s")
    lines = [head, "", table(report)]
    ns = notes(report)
    if ns:
        lines += [""] + [f"- {n}" for n in ns]
    return "\n".join(lines)
