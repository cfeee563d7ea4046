"""The thread that starts writer processes (the first and each replacement).

A child started with PR_SET_PDEATHSIG is killed when the *thread* that started it exits,
so the starting thread must last as long as the process.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class _Spawner:
    """Runs the calls given to it, one at a time, on a daemon thread of its own."""

    def __init__(self) -> None:
        self._calls: "queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]]" = (
            queue.SimpleQueue())
        threading.Thread(target=self._run, name="incluster-spawn", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "Future[Any]":
        fut: Future[Any] = Future()
        self._calls.put((fut, fn, args, kwargs))
        return fut

    def _run(self) -> None:
        while True:
            fut, fn, args, kwargs = self._calls.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
                    fut.set_exception(exc)


_spawn_pool: _Spawner | None = None
_spawn_lock = threading.Lock()


def writer_spawner() -> _Spawner:
    """The thread that starts writer processes. A writer is killed when the thread that
    started it exits (PR_SET_PDEATHSIG follows the thread), so that thread must live as
    long as the process: never a Checkpointer's staging thread, which ends at close(), nor
    the thread that made the Checkpointer, nor a pool's, which the interpreter joins at
    exit before the ``atexit`` hooks run (a ``close()`` there found its writer gone). A
    daemon thread is never joined: it lasts until the process ends."""
    global _spawn_pool
    with _spawn_lock:
        if _spawn_pool is None:
            _spawn_pool = _Spawner()
        return _spawn_pool


def _forked() -> None:
    global _spawn_pool, _spawn_lock
    _spawn_pool, _spawn_lock = None, threading.Lock()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forked)
