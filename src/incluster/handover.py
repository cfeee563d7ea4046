"""Handing saves to a writer process that is still starting, without holding up staging.

The writer process starts in the background (a fresh interpreter importing torch: 1-7 s)
and nothing waits for it: not the constructor, not ``load()``. A save made meanwhile must
still reach a writer that answered - one whose start fails holds no save, its successor
takes it - and the writer must hear of the steps in the order ``save()`` was called
(:mod:`incluster.writer.sequence`). Waiting for the start on the staging thread kept that
order, but it also kept the *next* save from being staged: the optimizer step after the
second save of a job waited ~1 s for the writer's start (measured on the 2-core machine).

:class:`HandOver` keeps the order without the wait. Each save is staged at once (the
optimizer may step); what needs the writer - the save's hand-off, or a step's FAIL - runs
at once when the start is over and nothing is queued, else it is queued, and the queue
runs on the staging thread, in order, as soon as the start ends (or fails: each action
finds the writer's successor itself).

``run`` may be called from any thread (a commit that failed is told on the writer's
reply thread); the queue itself runs on the staging thread.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger("incluster")
# In the error of a save given up for a newer one while the writer started, and in the
# FAIL the other ranks read: how every rank tells such a step from a failed one.
SUPERSEDED = "superseded by a newer save before its writer process had started"


class HandOver:
    """Actions that need the writer, run in the order given once its start is over.

    ``submit`` queues a callable on the staging thread (its executor's ``submit``);
    ``started`` returns the current writer's start future (None: nothing to wait for)."""

    def __init__(self, submit: Callable[[Callable[[], None]], Any], started: Callable[[], "Future[None] | None"]) -> None:
        self._submit = submit
        self._started = started
        self._queue: "collections.deque[list[Any]]" = collections.deque()  # [action, key]
        self._flusher: int | None = None  # the thread running the queue's head (None: no flush runs)
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Actions queued for the writer's start."""
        return len(self._queue)

    def run(self, action: Callable[[], None], key: Any = None) -> None:
        """``action`` now, on this thread, if the writer has answered and nothing waits
        before it; else after everything queued, once the start is over. ``key``: what a
        queued action may be found by (:meth:`supersede`)."""
        started = self._started()
        with self._lock:
            # Called by the running action itself (a hand-off that failed tells its FAIL):
            # in its place, not behind the later ones.
            if (not self._queue and (started is None or started.done())) or self._flusher == threading.get_ident():
                now = True
            else:
                now = False
                self._queue.append([action, key])
                first = len(self._queue) == 1
        if now:
            action()
        elif first and started is not None:  # later ones ride on this trigger (one flush runs them all)
            started.add_done_callback(lambda _: self._flush_soon())

    def _flush_soon(self) -> None:
        """The start is over (any thread): run the queue on the staging thread; at
        interpreter exit, when that thread is gone, here."""
        try:
            self._submit(self.flush)
        except RuntimeError:  # the executor is shut down (closing, or the interpreter exiting)
            self.flush()

    def supersede(self, instead: Callable[[Any], Callable[[], None]],
                  spare: Callable[[Any], bool] = lambda _: False) -> Any:
        """The key of the oldest queued action that has one and is not running - one
        ``spare(key)`` is False for if there is such - its action replaced in place by
        ``instead(key)`` (so the writer still hears of its step in order); None if there
        is none."""
        with self._lock:
            for spared in (False, True):
                for i, entry in enumerate(self._queue):
                    running = i == 0 and self._flusher is not None
                    if entry[1] is not None and not running and spare(entry[1]) == spared:
                        key, entry[1] = entry[1], None
                        entry[0] = instead(key)
                        return key
        return None

    def flush(self) -> None:
        """Run every queued action in order (each handles its own errors)."""
        while True:
            with self._lock:
                if not self._queue or (self._flusher is not None and self._flusher != threading.get_ident()):
                    return  # empty, or another thread's flush runs it (one at a time, in order)
                entry = self._queue[0]
                self._flusher = threading.get_ident()
            try:
                entry[0]()
            except Exception:  # noqa: BLE001 - an action reports through its save's futures
                log.exception("incluster: handing a save to the writer failed")
            finally:
                with self._lock:
                    self._queue.popleft()
                    self._flusher = None
