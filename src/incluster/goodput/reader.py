"""Reading a run folder's event files (written by ``goodput.events``) into attempts.

One file per process = one attempt of one rank. ``goodput.report`` and ``goodput.plot``
read runs through here. A truncated last line (a writer killed mid-line) is skipped; a
malformed line anywhere else is an error naming the file and line, because it means the
file is damaged, not cut short.
"""

from __future__ import annotations

import json
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
        """Whether the attempt recorded a clean ``end``."""
        return any(e["kind"] == ev.END for e in self.events)

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind."""
        return [e for e in self.events if e["kind"] == kind]


def read_file(path: Path) -> Attempt:
    """Decode one event file; skip a torn last line, reject damage elsewhere."""
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
            float(event["t"])
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
        raise ValueError(f"{path} holds no complete event; delete it or record into it")
    name = path.name  # events-rank00003-pid1234.jsonl
    try:
        rank = int(out[0].get("rank", name.split("-")[1][4:]))
        pid = int(out[0].get("pid", name.split("-pid")[1].split(".")[0]))
    except (IndexError, ValueError) as exc:
        raise ValueError(f"{path}: cannot tell rank and pid from the events or name") from exc
    return Attempt(rank=rank, pid=pid, path=path, events=out, truncated=truncated)


def read_run(run_dir: str | Path) -> dict[int, list[Attempt]]:
    """Every attempt of every rank in ``run_dir``, each rank's attempts in start order."""
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
    for f in files:
        a = read_file(f)
        by_rank.setdefault(a.rank, []).append(a)
    for attempts in by_rank.values():
        attempts.sort(key=lambda a: a.start_t)
    return dict(sorted(by_rank.items()))


__all__ = ["Attempt", "read_file", "read_run"]
