"""Reading a run folder's event files (written by ``goodput.events``) into attempts.

One file per process = one attempt of one rank (a file from before names held a
per-process token may hold several: see :func:`read_file`). ``goodput.report`` and ``goodput.plot``
read runs through here. A truncated last line (a writer killed mid-line) is skipped; a
malformed line anywhere else is an error naming the file and line, because it means the
file is damaged, not cut short.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from incluster.goodput import events as ev


@dataclass(kw_only=True)
class Attempt:
    """The events of one process: one attempt of one rank, in recorded order."""

    rank: int
    """The rank that wrote the file."""
    pid: int
    """The process id that wrote the file."""
    path: Path
    """The event file."""
    events: list[dict[str, Any]]
    """The decoded events, in file order."""
    truncated: bool = False
    """Whether a torn last line was skipped."""

    @property
    def start_t(self) -> float:
        """Wall time the attempt began: its ``start`` event, else its first event."""
        for e in self.events:
            if e["kind"] == ev.START:
                return float(e["t"])
        return float(self.events[0]["t"])

    @property
    def last_t(self) -> float:
        """Wall time of the attempt's last recorded event."""
        return max(float(e["t"]) for e in self.events)

    @property
    def ended(self) -> bool:
        """Whether the attempt ended cleanly: an ``end`` after its last ``start`` (a process
        whose second Checkpointer was killed did not)."""
        marks = [e["kind"] for e in self.events if e["kind"] in (ev.START, ev.END)]
        return bool(marks) and marks[-1] == ev.END

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind."""
        return [e for e in self.events if e["kind"] == kind]


def read_file(path: Path) -> list[Attempt]:
    """Decode one event file into its attempts; skip a torn last line, reject damage
    elsewhere. A file holds one process's events - and, written before file names held a
    per-process token, those of a later process that got the same pid: a ``start`` of
    another ``proc``, or one after a segment that never ended (a killed process), opens
    a new attempt. (Checkpointers one after another in one process are one attempt.)"""
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    torn = lines[-1] != b""  # a complete file ends with a newline
    if not torn:
        lines = lines[:-1]
    out: list[dict[str, Any]] = []
    truncated = False
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        try:
            event = json.loads(line)
            if not isinstance(event, dict) or "t" not in event or "kind" not in event:
                raise ValueError("not an event object with 't' and 'kind'")
            t = float(event["t"])
            if not math.isfinite(t):
                raise ValueError(f"time {event['t']!r}")
            for key in _DURATIONS:  # a negative or endless duration would skew every figure
                v = event.get(key)
                if v is not None and (type(v) not in (int, float) or not math.isfinite(v) or v < 0):
                    raise ValueError(f"{key} {v!r} is not a number >= 0")
        except (ValueError, TypeError) as exc:
            if last and torn:
                truncated = True
                continue
            raise ValueError(
                f"{path}:{i + 1}: damaged event line ({exc}); only the last line of a file "
                "may be torn (a killed writer). Move the file aside to report without it."
            ) from exc
        if last and torn:  # a complete JSON object without its newline is still whole
            truncated = False
        out.append(event)
    if not out:
        raise EmptyFile(f"{path} holds no complete event")
    m = _NAME.match(path.name)
    try:
        rank = int(out[0]["rank"] if "rank" in out[0] else (m.group(1) if m else ""))
        pid = int(out[0]["pid"] if "pid" in out[0] else (m.group(2) if m else ""))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: cannot tell rank and pid from the events or name") from exc
    attempts: list[Attempt] = []
    seg: list[dict[str, Any]] = []
    proc = ended = None
    for e in out:
        if e["kind"] == ev.START and seg:
            other = e.get("proc") is not None and proc is not None and e.get("proc") != proc
            if other or (e.get("proc") is None and not ended):
                attempts.append(Attempt(rank=rank, pid=pid, path=path, events=seg))
                seg, ended = [], None
        if e["kind"] == ev.START:
            proc = e.get("proc", proc)
        ended = ended or e["kind"] == ev.END
        seg.append(e)
    attempts.append(Attempt(rank=rank, pid=pid, path=path, events=seg, truncated=truncated))
    return attempts


_DURATIONS = ("blocked_s", "seconds", "bytes", "staged_s", "durable_s")


class EmptyFile(ValueError):
    """An event file with no complete event (a process killed before its first write)."""


_NAME = re.compile(r"^events-rank(\d+)-pid(\d+)(?:-[0-9a-f]+)?\.jsonl$")


def read_run(run_dir: str | Path, skipped: list[Path] | None = None) -> dict[int, list[Attempt]]:
    """Every attempt of every rank in ``run_dir``, each rank's attempts in start order.
    Files with no complete event are left out (listed in ``skipped``); with none left,
    the run cannot be read."""
    run = Path(run_dir)
    files = sorted(run.glob("events-*.jsonl"))
    if not files:
        raise ValueError(
            (f"no events-*.jsonl in {run}: pass the folder the run recorded its events to "
             f"(a run records them only when given run_dir= or INCLUSTER_RUN_DIR)")
            if run.is_dir() else
            f"{run} is not a folder: pass the run_dir (or INCLUSTER_RUN_DIR) the run recorded its events to"
        )
    by_rank: dict[int, list[Attempt]] = {}
    empty: list[Path] = []
    for f in files:
        try:
            attempts = read_file(f)
        except EmptyFile:
            empty.append(f)
            continue
        for a in attempts:
            by_rank.setdefault(a.rank, []).append(a)
    if skipped is not None:
        skipped.extend(empty)
    if not by_rank:
        raise ValueError(f"{', '.join(map(str, empty))} hold(s) no complete event; record a run into {run} first")
    for attempts in by_rank.values():
        attempts.sort(key=lambda a: a.start_t)
    return dict(sorted(by_rank.items()))


__all__ = ["Attempt", "EmptyFile", "read_file", "read_run"]
