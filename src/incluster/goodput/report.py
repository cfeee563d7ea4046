"""Goodput report: a recorded run's events (``goodput.events``) → where its time went.

Reads every ``events-*.jsonl`` of a run folder (one file per process: one attempt of one
rank; a restart is a new attempt) and accounts each rank's share of the run's wall-clock
window ``[first start, last event]`` to exactly one category:

- **checkpoint save**: seconds ``save()`` blocked the trainer (``save.blocked_s``, which
  includes waiting for a free slot) plus seconds the optimizer pre-step hook waited for a
  save's copy (``stage_wait.seconds``).
- **checkpoint load**: seconds ``load()`` took (``load.seconds``).
- **lost progress**: time spent on steps that a later attempt computed again. Attempt *j*'s
  work after the last moment it held a step <= S is lost, where S is the lowest step any
  later attempt restored (``load.step``; null = from scratch = step -1). The moment a step
  was held comes from ``train_step`` events, from ``save`` (``t - blocked_s``) and from
  ``load`` ends. The attempt's work ends at its last event. Save and load time inside the
  lost window stay in their own categories.
- **restart / initialisation**: the gap between an attempt's last event and the next
  attempt's start, plus each attempt's time from its start to its first progress marker
  (a load's end, a step or a save), minus load time. Without a ``load`` or ``save`` the
  first step's compute is counted here: the recorder cannot tell it from warm-up.
- **other**: the part of the run's window a rank has no record for (it started later or
  stopped earlier than the others).

What remains is goodput. Categories are averaged over ranks (GPU-time weighted, as every
rank spans the same window). Reading the files (and their torn last lines) is
``goodput.reader``'s job.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from incluster.goodput import events as ev
from incluster.goodput.reader import Attempt, read_run

CATEGORIES = ("checkpoint_save", "checkpoint_load", "lost_progress", "restart", "other")


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; None if empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _num(e: dict[str, Any], key: str) -> float:
    v = e.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _marks(a: Attempt) -> list[tuple[float, float]]:
    """(step, time) pairs at which the attempt held that step's state."""
    out: list[tuple[float, float]] = []
    for e in a.events:
        step = e.get("step")
        if e["kind"] == ev.TRAIN_STEP and isinstance(step, int):
            out.append((step, float(e["t"])))
        elif e["kind"] == ev.SAVE and isinstance(step, int):
            out.append((step, float(e["t"]) - _num(e, "blocked_s")))
        elif e["kind"] == ev.LOAD:
            out.append((step if isinstance(step, int) else -1, float(e["t"])))
    return out


def _restored_step(a: Attempt) -> float | None:
    """The step an attempt resumed from: its load's step (-1 = scratch), else inferred."""
    loads = a.of(ev.LOAD)
    if loads:
        step = loads[0].get("step")
        return step if isinstance(step, int) else -1
    steps = [s for s, _ in _marks(a)]
    return min(steps) - 1 if steps else None


def _busy(a: Attempt, lo: float, hi: float) -> float:
    """Save-blocked, load and close() seconds of events recorded in (lo, hi]."""
    total = 0.0
    for e in a.events:
        if lo < float(e["t"]) <= hi:
            if e["kind"] == ev.SAVE:
                total += _num(e, "blocked_s")
            elif e["kind"] == ev.STAGE_WAIT:
                total += _num(e, "seconds")
            elif e["kind"] in (ev.LOAD, ev.END):  # end: close() draining, counted as save time
                total += _num(e, "seconds")
    return total


def at_risk(a: Attempt) -> float | None:
    """An attempt with no ``end`` (killed, or still running when read): the seconds of
    work since it held its newest durable step (its restored step if none became durable),
    which a restart now would lose; None for an attempt that ended cleanly. Counted as
    goodput until a later attempt shows what was restored."""
    if a.ended:
        return None
    durable = a.of(ev.DURABLE)
    world = max((int(e["world_size"]) for e in a.of(ev.START) if isinstance(e.get("world_size"), int)), default=0)
    if world > 1 or any(e.get("tier") == "global" for e in durable):  # a step this rank alone holds is no restart's
        durable = [e for e in durable if e.get("tier") in ("global", "persistent")]
    steps = [s for s in (e.get("step") for e in durable) if isinstance(s, int)]
    newest = max(steps) if steps else _restored_step(a)
    marks = _marks(a)
    held = [t for s, t in marks if newest is not None and s <= newest]
    t_ref = max(held) if held else min((t for _, t in marks), default=a.last_t)
    return max(0.0, a.last_t - t_ref - _busy(a, t_ref, a.last_t))


def restores(runs: dict[int, list[Attempt]]) -> list[tuple[float, float]]:
    """(start time, restored step) of every attempt of every rank that says what it resumed
    from: after a restart into fewer ranks (or ranks renumbered) a rank's work is settled
    by the restore of whichever attempts came next, not by a later attempt of its number."""
    return [(b.start_t, s) for attempts in runs.values() for b in attempts if (s := _restored_step(b)) is not None]


def _later(a: Attempt, attempts: list[Attempt], j: int, restored: list[tuple[float, float]] | None) -> list[float]:
    """The steps later attempts resumed from: any rank's attempt begun after ``a`` ended
    (with ``restored``), else this rank's own later attempts."""
    if restored is None:
        return [s for s in (_restored_step(b) for b in attempts[j + 1 :]) if s is not None]
    return [s for t, s in restored if t > a.last_t]


def account_rank(
    attempts: list[Attempt], t0: float, t1: float, restored: list[tuple[float, float]] | None = None,
) -> dict[str, float]:
    """Seconds per category (and ``goodput``) for one rank within the window [t0, t1];
    ``restored``: :func:`restores` of the whole run."""
    acc = dict.fromkeys(CATEGORIES, 0.0)
    for a in attempts:
        acc["checkpoint_save"] += sum(_num(e, "blocked_s") for e in a.of(ev.SAVE))
        acc["checkpoint_save"] += sum(_num(e, "seconds") for e in a.of(ev.STAGE_WAIT))
        acc["checkpoint_load"] += sum(_num(e, "seconds") for e in a.of(ev.LOAD))
        acc["checkpoint_save"] += sum(_num(e, "seconds") for e in a.of(ev.END))  # close() draining
    for j, a in enumerate(attempts):
        marks = _marks(a)
        progress_t = min((t for _, t in marks), default=a.last_t)
        init = progress_t - a.start_t - _busy(a, a.start_t - 1e-9, progress_t)
        acc["restart"] += max(0.0, init)
        if j > 0:
            # After a clean end nothing waited on a failure: a later relaunch (to train on)
            # is not a restart's cost
            gap = max(0.0, a.start_t - attempts[j - 1].last_t)
            acc["other" if attempts[j - 1].ended else "restart"] += gap
        later = _later(a, attempts, j, restored)
        if not later:
            continue
        redo_from = min(later)
        held = [t for s, t in marks if s <= redo_from]
        t_ref = max(held) if held else progress_t
        lost = a.last_t - t_ref - _busy(a, t_ref, a.last_t)
        acc["lost_progress"] += max(0.0, lost)
    acc["other"] += max(0.0, attempts[0].start_t - t0) + max(0.0, t1 - attempts[-1].last_t)
    acc["goodput"] = max(0.0, (t1 - t0) - sum(acc[c] for c in CATEGORIES))
    return acc


@dataclass(kw_only=True)
class CheckpointStats:
    """Checkpoint statistics over all ranks and attempts (seconds unless named otherwise)."""

    saves: int
    """``save()`` calls recorded."""
    save_failures: int
    """Saves that failed in the background."""
    save_superseded: int = 0
    """Saves given up for a newer one while a writer process was starting (not failures:
    no step could be durable before that start; see ``Checkpointer.save``)."""
    blocked_p50_s: float | None
    """Median seconds ``save()`` blocked."""
    blocked_p99_s: float | None
    """99th percentile of seconds ``save()`` blocked."""
    staged_p50_s: float | None
    """Median seconds from ``save()`` to staged."""
    staged_p99_s: float | None
    """99th percentile of seconds from ``save()`` to staged."""
    durable: dict[str, dict[str, float | None]]
    """Per tier: ``count``, ``p50_s``, ``p99_s`` of seconds from ``save()`` to durable."""
    loads: int
    """``load()`` calls recorded."""
    load_p50_s: float | None
    """Median seconds ``load()`` took."""
    load_p99_s: float | None
    """99th percentile of seconds ``load()`` took."""
    load_bytes: int
    """Bytes restored by all loads."""
    load_sources: dict[str, int]
    """How many loads came from each source."""
    persist_failures: int = 0
    """Persistent uploads that failed."""
    persist_skips: int = 0
    """Persistent uploads skipped: the previous one was still running."""


def checkpoint_stats(runs: dict[int, list[Attempt]]) -> CheckpointStats:
    """Summarise every save, staged, durable and load event of a run."""
    all_events = [e for attempts in runs.values() for a in attempts for e in a.events]

    def of(kind: str) -> list[dict[str, Any]]:
        return [e for e in all_events if e["kind"] == kind]

    blocked = [_num(e, "blocked_s") for e in of(ev.SAVE)]
    staged = [_num(e, "seconds") for e in of(ev.STAGED)]
    durable: dict[str, dict[str, float | None]] = {}
    for tier in sorted({str(e.get("tier")) for e in of(ev.DURABLE)}):
        secs = [_num(e, "seconds") for e in of(ev.DURABLE) if str(e.get("tier")) == tier]
        durable[tier] = {
            "count": float(len(secs)),
            "p50_s": percentile(secs, 50),
            "p99_s": percentile(secs, 99),
        }
    sources: dict[str, int] = {}
    for e in of(ev.LOAD):
        src = str(e.get("source", "unknown"))
        sources[src] = sources.get(src, 0) + 1
    return CheckpointStats(
        saves=len(blocked),
        save_failures=sum(1 for e in of(ev.SAVE_FAILED) if not e.get("superseded")),
        save_superseded=sum(1 for e in of(ev.SAVE_FAILED) if e.get("superseded")),
        blocked_p50_s=percentile(blocked, 50),
        blocked_p99_s=percentile(blocked, 99),
        staged_p50_s=percentile(staged, 50),
        staged_p99_s=percentile(staged, 99),
        durable=durable,
        loads=len(of(ev.LOAD)),
        load_p50_s=percentile([_num(e, "seconds") for e in of(ev.LOAD)], 50),
        load_p99_s=percentile([_num(e, "seconds") for e in of(ev.LOAD)], 99),
        load_bytes=int(sum(_num(e, "bytes") for e in of(ev.LOAD))),
        load_sources=sources,
        persist_failures=sum(1 for e in of(ev.PERSIST_FAILED) if not e.get("skipped")),
        persist_skips=sum(1 for e in of(ev.PERSIST_FAILED) if e.get("skipped")),
    )


@dataclass(kw_only=True)
class GoodputReport:
    """Where a recorded run's time went. Seconds are means over ranks."""

    run_dir: str
    """The folder the events were read from."""
    ranks: int
    """Ranks that recorded events."""
    attempts: int
    """Most attempts (processes) any rank had; restarts = attempts - 1."""
    wall_s: float
    """Seconds from the first start to the last event of the run."""
    goodput_s: float
    """Seconds of progress that was kept."""
    badput_s: dict[str, float]
    """Seconds per category (``CATEGORIES``)."""
    checkpoints: CheckpointStats
    """Save, durable and load statistics."""
    truncated_files: int = 0
    empty_files: list[str] = field(default_factory=list)
    """Event files left out: no complete event (a process killed before its first write)."""
    """Files whose torn last line was skipped."""
    per_rank: dict[int, dict[str, float]] = field(default_factory=dict)
    """Seconds per category and ``goodput`` for each rank."""
    unfinished: dict[int, float] = field(default_factory=dict)
    """Ranks whose last attempt recorded no ``end`` (killed, or still running when read):
    the seconds since its newest durable step that a restart would lose (:func:`at_risk`).
    They are in ``goodput_s`` until a later attempt restores."""

    @property
    def goodput_pct(self) -> float:
        """Goodput as a percentage of wall time."""
        return 100.0 * self.goodput_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def badput_pct(self) -> dict[str, float]:
        """Badput per category as a percentage of wall time."""
        w = self.wall_s
        return {k: (100.0 * v / w if w > 0 else 0.0) for k, v in self.badput_s.items()}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the whole report."""
        d = asdict(self)
        d["goodput_pct"] = self.goodput_pct
        d["badput_pct"] = self.badput_pct
        d["per_rank"] = {str(k): v for k, v in self.per_rank.items()}
        return d


def build_report(run_dir: str | Path) -> GoodputReport:
    """Read a run folder's events and account its wall time."""
    skipped: list[Path] = []
    runs = read_run(run_dir, skipped)
    t0 = min(a.start_t for attempts in runs.values() for a in attempts)
    t1 = max(a.last_t for attempts in runs.values() for a in attempts)
    restored = restores(runs)
    per_rank = {r: account_rank(attempts, t0, t1, restored) for r, attempts in runs.items()}
    n = len(per_rank)
    mean = {k: sum(p[k] for p in per_rank.values()) / n for k in (*CATEGORIES, "goodput")}
    return GoodputReport(
        run_dir=str(run_dir),
        ranks=n,
        attempts=max(len(a) for a in runs.values()),
        wall_s=t1 - t0,
        goodput_s=mean["goodput"],
        badput_s={k: mean[k] for k in CATEGORIES},
        checkpoints=checkpoint_stats(runs),
        truncated_files=sum(a.truncated for attempts in runs.values() for a in attempts),
        empty_files=[str(p) for p in skipped],
        per_rank=per_rank,
        unfinished={r: risk for r, attempts in runs.items()
                    if not _later(attempts[-1], attempts, len(attempts) - 1, restored)
                    and (risk := at_risk(attempts[-1])) is not None},
    )


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ", ".join(map(str, ranks))


def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "—"
    return f"{x * 1e3:.1f} ms" if unit == "s" and x < 1 else f"{x:.2f} {unit}"


def render(report: GoodputReport, console: Any = None) -> None:
    """Print the report as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head = Table(title=f"goodput of {report.run_dir}", show_header=False)
    head.add_row("wall time", f"{report.wall_s:.1f} s")
    head.add_row("ranks / attempts", f"{report.ranks} / {report.attempts}")
    head.add_row("goodput", f"{report.goodput_pct:.2f} %  ({report.goodput_s:.1f} s)")
    if report.truncated_files:
        head.add_row("torn last lines skipped", str(report.truncated_files))
    if report.empty_files:
        head.add_row("empty event files left out", str(len(report.empty_files)))
    console.print(head)
    bad = Table(title="badput (mean over ranks)")
    for col in ("category", "seconds", "% of wall"):
        bad.add_column(col, justify="left" if col == "category" else "right")
    for k in CATEGORIES:
        bad.add_row(k.replace("_", " "), f"{report.badput_s[k]:.2f}", f"{report.badput_pct[k]:.2f}")
    console.print(bad)
    console.print("restart: from a process's last event to its successor's first (relaunch, imports, process "
                  "group, model build); the restore itself is checkpoint load", style="dim")
    if report.unfinished:
        ranks = sorted(report.unfinished)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks ({_span(ranks)})"
        risk = sum(report.unfinished.values()) / len(ranks)
        console.print(f"{who}: the last process recorded no end (killed, or still running, or it never called "
                      f"Checkpointer.close()): if it was killed, "
                      f"the {risk:.2f} s since its newest durable step{' (mean)' if len(ranks) > 1 else ''} "
                      f"are lost too; they count as goodput here until a restart's load shows what was restored",
                      style="yellow")
    c = report.checkpoints
    st = Table(title="checkpoints")
    for col in ("metric", "count", "p50", "p99"):
        st.add_column(col, justify="left" if col == "metric" else "right")
    st.add_row("save() blocked", str(c.saves), _fmt(c.blocked_p50_s), _fmt(c.blocked_p99_s))
    st.add_row("save → staged", "", _fmt(c.staged_p50_s), _fmt(c.staged_p99_s))
    for tier, d in c.durable.items():
        st.add_row(f"save → durable ({tier})", str(int(d["count"] or 0)), _fmt(d["p50_s"]),
                   _fmt(d["p99_s"]))
    st.add_row("save failures", str(c.save_failures), "", "")
    if c.save_superseded:
        st.add_row("given up for a newer save", str(c.save_superseded), "", "")  # the writer starting
    if c.persist_failures or c.persist_skips:
        st.add_row("persistent uploads failed / skipped", f"{c.persist_failures} / {c.persist_skips}", "", "")
    st.add_row(f"load() ({c.load_bytes / 2**30:.2f} GiB in all)", str(c.loads),
               _fmt(c.load_p50_s), _fmt(c.load_p99_s))
    console.print(st)
    if c.load_sources:
        named = {"none": "nothing to restore (a fresh start)"}
        srcs = ", ".join(f"{named.get(k, k)}: {v}" for k, v in sorted(c.load_sources.items()))
        console.print(f"loads by source: {srcs}")


__all__ = [
    "CATEGORIES",
    "Attempt",
    "CheckpointStats",
    "GoodputReport",
    "account_rank",
    "at_risk",
    "build_report",
    "checkpoint_stats",
    "percentile",
    "read_run",
    "render",
]
