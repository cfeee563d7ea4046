"""Event recording: the trainer-side half of goodput accounting.

The ``Checkpointer`` (and a user's training loop, through ``record_step``) records what
happened and when as JSON lines in a run folder the user chooses; ``goodput.report`` reads
them back, across restarts, and turns them into a goodput report. Nothing here touches
torch, and a recorder never raises out of ``record()`` because of a full disk or a closed
file: losing an event must never stop training.

One file per process: ``<run_dir>/events-rank{rank:05d}-pid{pid}-{proc}.jsonl`` (``proc``
drawn per process: a restart that gets the same pid still writes a new file). A process
is one *attempt* of one rank; a restart is a new process, hence a new file that opens with
a ``start`` event. Every line holds ``t`` (wall time, seconds since the epoch), ``kind``,
``rank``, ``pid`` and the kind's own fields (see the constants below); ``start`` also
holds ``proc``.

Cost on the recording thread: one ``json.dumps`` and a deque append (a few microseconds):
no file I/O and no lock. ``save()`` records an event on the training thread, and a write
there would hand the interpreter lock to the staging thread it just started for up to a
switch interval (5 ms) - ten times what ``save()`` itself blocks. A writer thread of the
recorder writes the lines: at once (within milliseconds) for a checkpoint-scale event
(anything but ``train_step``), every ``flush_every`` events, and every ``flush_interval_s``.
It also writes an ``alive`` event each interval while training runs: the Checkpointer's
optimizer pre-step hook calls :meth:`EventRecorder.alive` as each step begins, and while
the latest step began less than two step times (plus an interval) ago the process counts
as training at the moment of the write; a step that long ago or older means a pause (an
evaluation, a hang), and the event says when that step began. So a SIGKILLed process is
known to have been training until at most ``flush_interval_s`` before it died, with or
without ``train_step`` events, however long its steps are. The data reach the kernel (``write``), not the disk (no
``fsync``): a killed process loses nothing that was written; only a crashed kernel could.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable

#: A process (one attempt of one rank) began. Fields: ``world_size``.
START = "start"
#: ``save()`` returned. Fields: ``step``, ``blocked_s`` (seconds it blocked the trainer).
SAVE = "save"
#: The state of a save was copied; tensors may be mutated. Fields: ``step``, ``seconds``
#: (since ``save()`` was called).
STAGED = "staged"
#: A save became recoverable from a tier. Fields: ``step``, ``tier`` (one of ``TIERS``),
#: ``seconds`` (since ``save()`` was called).
DURABLE = "durable"
#: The trainer waited in the optimizer pre-step hook for a save's copy (or a restore's
#: heal) to finish: save cost, not training. Fields: ``step``, ``seconds``.
STAGE_WAIT = "stage_wait"
#: A save failed in the background. Fields: ``step``, ``error`` (the message).
SAVE_FAILED = "save_failed"
#: A save's persistent upload did not happen. Fields: ``step``, ``error`` (the message),
#: ``skipped`` (true: the previous upload was still running; false: it failed).
PERSIST_FAILED = "persist_failed"
#: ``load()`` finished. Fields: ``step`` (restored step, or null when nothing was found
#: and training starts from scratch), ``source`` (where the bytes came from, e.g. "local",
#: "replica", "persistent", "none"), ``bytes``, ``seconds`` (how long load() took, the
#: writer process's start included), ``restore_s`` (of that, the restore itself).
LOAD = "load"
#: Training finished a step: its optimizer update is applied. Fields: ``step``. Optional;
#: with it, lost progress is measured to the step instead of to the last save.
TRAIN_STEP = "train_step"
#: Training was running at ``t``: the write's own time while steps keep beginning, else
#: when the latest optimizer step began (written by the recorder at most every
#: ``flush_interval_s``). No fields.
ALIVE = "alive"
#: The run finished cleanly (``Checkpointer.close()`` after the last step). Fields:
#: ``seconds`` (how long close() took: draining saves and uploads in flight).
END = "end"

KINDS = (START, SAVE, STAGED, STAGE_WAIT, DURABLE, SAVE_FAILED, PERSIST_FAILED, LOAD, TRAIN_STEP, ALIVE, END)
TIERS = ("local", "global", "persistent")  # global: complete on every rank (replicas included)

#: Kinds that are written at once: they are rare (checkpoint-scale) and the report needs them.
_IMMEDIATE = frozenset(KINDS) - {TRAIN_STEP, ALIVE}


def event_file_name(rank: int, pid: int, proc: str = "") -> str:
    """The file name one process writes its events to. ``proc``: the process's token
    (:func:`process_token`): a restarted process often gets the same pid (a container's
    first process is pid 1 or 2 every time), and a shared file would hide the restart."""
    return f"events-rank{rank:05d}-pid{pid}{'-' + proc if proc else ''}.jsonl"


_token: str | None = None


def process_token() -> str:
    """Twelve hex digits drawn once per process (again in a forked child)."""
    global _token
    if _token is None:
        import uuid

        _token = uuid.uuid4().hex[:12]
    return _token


def _forget_token() -> None:
    global _token
    _token = None


os.register_at_fork(after_in_child=_forget_token)


class EventRecorder:
    """Appends events of one process to its JSON-lines file in ``run_dir``.

    Thread-safe: the checkpointer records ``staged``/``durable`` from background threads.
    ``clock`` returns wall time in seconds (``time.time``); tests pass a fake one.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int = 0,
        *,
        clock: Callable[[], float] = time.time,
        flush_interval_s: float = 0.5,
        flush_every: int = 256,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.pid = os.getpid()
        self._clock = clock
        self._flush_interval_s = flush_interval_s
        self._flush_every = flush_every
        self._pending: deque[str] = deque()  # appended by any thread, drained by the writer
        self._lock = threading.Lock()  # the file: the writer thread, flush() and close()
        self._wake = threading.Event()
        self._closed = False
        self._alive_t = 0.0  # when the latest optimizer step began (alive())
        self._gaps: deque[float] = deque(maxlen=8)  # times between the latest steps' beginnings
        self._step_s = 0.0  # the shortest of them: a step, not an evaluation pause between two
        self._alive_told = 0.0
        self.dropped = 0  # events lost to an I/O error or recorded after close(); never raised
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.proc = process_token()
        self.path = self.run_dir / event_file_name(rank, self.pid, self.proc)
        self._file: Any = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._thread = threading.Thread(target=self._run, name="incluster-events", daemon=True)
        self._thread.start()
        _live.add(self)

    def record(self, kind: str, **fields: Any) -> None:
        """Record one event now. ``kind`` is one of ``KINDS``; fields should be JSON-able
        (anything else is written as its ``str``)."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; use one of {', '.join(KINDS)}")
        if self._closed:
            self.dropped += 1
            return
        event = {"t": self._clock(), "kind": kind, "rank": self.rank, "pid": self.pid}
        if kind == START:
            event["proc"] = self.proc
        event.update(fields)
        # default=str: an odd field value (a Path, a tensor's item) must not stop training
        self._pending.append(json.dumps(event, separators=(",", ":"), default=str) + "\n")
        if self._file is None:  # close() wrote its last lines before this one arrived: counted
            while self._pending:
                self._pending.popleft()
                self.dropped += 1
            return
        if kind in _IMMEDIATE or len(self._pending) >= self._flush_every:
            self._wake.set()

    def alive(self) -> None:
        """Training is running (an optimizer step begins): plain stores, no I/O."""
        now = self._clock()
        if self._alive_t:
            self._gaps.append(now - self._alive_t)
            self._step_s = min(self._gaps)
        self._alive_t = now

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Write every pending event to the file."""
        with self._lock:
            if self._file is not None:
                self._write_locked()

    def close(self) -> None:
        """Flush and close. Later ``record()`` calls are counted in ``dropped``."""
        self._closed = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._lock:
            if self._file is None:
                return
            self._write_locked(closing=True)
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def _write_locked(self, closing: bool = False) -> None:
        alive = self._alive_t
        if alive and not closing:
            now = self._clock()
            if now - alive <= 2 * self._step_s + self._flush_interval_s:
                alive = now  # inside a step (or between two): training until now
        if alive > self._alive_told:
            self._alive_told = alive
            self._pending.append(json.dumps({"t": alive, "kind": ALIVE, "rank": self.rank, "pid": self.pid},
                                            separators=(",", ":")) + "\n")
        lines = []
        while self._pending:
            lines.append(self._pending.popleft())
        if not lines:
            return
        try:
            self._file.write("".join(lines))
            self._file.flush()
        except OSError:
            # WARNING: a full disk must not stop training; the loss is counted instead.
            self.dropped += len(lines)

    def __enter__(self) -> EventRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _after_fork(self) -> None:
        """In a forked child: the writer thread is gone and the lock may be held by it;
        the file is the parent's. The child records nothing (counted in ``dropped``)."""
        self._lock = threading.Lock()
        self._closed = True
        self._pending.clear()
        self._file = None


_live: "weakref.WeakSet[EventRecorder]" = weakref.WeakSet()


def _flush_all() -> None:
    """At exit: a process that never called close() still writes its last lines."""
    for rec in list(_live):
        rec.flush()


def _forked() -> None:
    for rec in list(_live):
        rec._after_fork()


atexit.register(_flush_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class NullRecorder:
    """A recorder that records nothing: used when the user gives no run folder."""

    dropped = 0

    def record(self, kind: str, **fields: Any) -> None:
        """Do nothing."""

    def alive(self) -> None:
        """Do nothing."""

    def flush(self) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""

    def __enter__(self) -> NullRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


#: A shared do-nothing recorder.
NULL_RECORDER = NullRecorder()

__all__ = [
    "ALIVE",
    "DURABLE",
    "END",
    "KINDS",
    "LOAD",
    "NULL_RECORDER",
    "SAVE",
    "SAVE_FAILED",
    "PERSIST_FAILED",
    "STAGED",
    "START",
    "TIERS",
    "TRAIN_STEP",
    "EventRecorder",
    "NullRecorder",
    "event_file_name",
]
