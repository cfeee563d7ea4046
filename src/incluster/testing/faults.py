"""Fault injection at named phases of a save or restore, for tests (yours and ours).

Faults travel in the ``INCLUSTER_FAULTS`` environment variable (JSON), so they reach
processes the library starts itself (the writer process) and processes a test launches:

    env = FaultInjector().fail_at(rank=1, step=3, phase="commit", action="kill").env()

Phases: ``stage`` (trainer, staging thread, before copying), ``commit`` (writer, before
the checksum), ``sidecar`` (writer, after the rename, before the commit record),
``counted`` (writer, after the commit is counted in the job store, before the trainer is told),
``replicate`` (writer, before exchanging replicas), ``upload`` (writer, after the
shard's upload, before its sidecar and the manifest), ``load-transfer`` (every rank,
after the copies are verified, before a restore moves or loads bytes; ``load`` is the
same), ``allocate`` (creating or growing a slot file, at the ``fallocate`` call),
``heal`` (trainer, staging thread, before a peer restore's copy is written to its node),
``handoff`` (trainer, staging thread, after the writer has the save, before the trainer
listens for its outcomes: a ``slow`` fault lets the writer's replies come first),
``writer-start`` (writer process, before it answers its trainer's greeting; the step is
its incarnation: 0 the first writer of a Checkpointer, 1 the one started after it died).

Actions: ``raise`` (an :class:`InjectedFault`), ``enospc`` (an ``OSError`` with
``ENOSPC``, as a full RAM disk gives), ``slow`` (sleep ``seconds``, 2 by default, then go on: widens a race, or plays a slow peer), ``kill`` (SIGKILL of the process at that instant),
``hang`` (touch ``<marker_dir>/fault-<phase>-r<rank>-s<step>`` then sleep, for an outside
kill: a peer that stops answering).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any

ENV = "INCLUSTER_FAULTS"
PHASES = ("stage", "commit", "sidecar", "counted", "replicate", "outcome", "upload", "load-transfer", "load", "allocate", "heal",
          "handoff", "writer-start")
_ALIASES = {"load": "load-transfer"}
SLOW_S = 2.0
ACTIONS = ("raise", "enospc", "slow", "kill", "hang")


class InjectedFault(OSError):
    """Raised by a ``raise`` fault; an OSError so it travels like a real I/O failure."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    phase: str
    action: str = "raise"
    rank: int | None = None  # None: every rank
    step: int | None = None  # None: every step
    marker_dir: str | None = None
    seconds: float = SLOW_S  # how long a ``slow`` fault sleeps

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES} (got {self.phase!r})")
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS} (got {self.action!r})")
        if self.action == "hang" and not self.marker_dir:
            raise ValueError("a 'hang' fault needs marker_dir, where it signals that it is hanging")

    def matches(self, phase: str, rank: int, step: int | None) -> bool:
        return (
            _ALIASES.get(self.phase, self.phase) == _ALIASES.get(phase, phase)
            and (self.rank is None or self.rank == rank)
            and (self.step is None or self.step == step)
        )


class FaultInjector:
    """Fluent builder of faults; ``env()``/``install()`` hand them to processes."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []

    def fail_at(self, *, phase: str, rank: int | None = None, step: int | None = None,
                action: str = "raise", marker_dir: str | None = None, seconds: float = SLOW_S) -> "FaultInjector":
        self.faults.append(Fault(phase=phase, action=action, rank=rank, step=step, marker_dir=marker_dir,
                                 seconds=seconds))
        return self

    def env(self) -> dict[str, str]:
        return {ENV: json.dumps([asdict(f) for f in self.faults])}

    def install(self) -> None:
        """Set the faults for this process and the processes it starts from now on."""
        os.environ.update(self.env())


_cache: tuple[str, list[Fault]] = ("", [])


def _faults() -> list[Fault]:
    global _cache
    raw = os.environ.get(ENV, "")
    if raw != _cache[0]:
        _cache = (raw, [Fault(**f) for f in json.loads(raw)] if raw else [])
    return _cache[1]


def check(phase: str, rank: int, step: int | None) -> None:
    """Fire the first fault matching this point, if any. Costs one lookup when none is set."""
    if ENV not in os.environ:
        return
    for f in _faults():
        if f.matches(phase, rank, step):
            _fire(f, rank, step)


def _fire(f: Fault, rank: int, step: int | None) -> Any:
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if f.action == "hang":
        open(os.path.join(str(f.marker_dir), f"fault-{f.phase}-r{rank}-s{step}"), "w").close()
        while True:
            time.sleep(3600)
    if f.action == "slow":
        time.sleep(f.seconds)
        return None
    if f.action == "enospc":
        raise InjectedFault(errno.ENOSPC, f"No space left on device (injected at {f.phase}, rank {rank}, step {step})")
    raise InjectedFault(errno.EIO, f"injected fault at {f.phase} (rank {rank}, step {step})")
