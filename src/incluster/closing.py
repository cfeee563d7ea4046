"""Closing a Checkpointer, and the API lock that save() and close() share.

Mixin of :class:`~incluster.checkpointer.Checkpointer`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Iterator

from incluster import wiring
from incluster.catch_up import catch_up
from incluster.errors import CheckpointError
from incluster.goodput import events as ev

log = logging.getLogger("incluster")


class Teardown:
    """Mixin: ``close()``, leaving the with-block, and the API lock (``_api_call``)."""

    config: Any
    rank: int
    world_size: int
    ring: Any
    events: Any
    _api: Any
    _api_threads: dict[int, str]  # thread id -> the API call it is inside
    _pid: int
    _closed: bool
    _lock: threading.Lock
    _guard: Any
    _stage_pool: Any
    _stager: Any
    _uploads: dict[tuple[int, int], Any]
    _writer: Any
    _writer_lock: threading.Lock
    _checked_out: bool
    _store_server: Any
    _store_address: Any
    _loads: int
    _last_step: int
    _claim: Any
    _wait: Any  # ErrorReports
    _hand_over_queued: Any  # SavePipeline
    _persisted: Any  # SavePipeline

    @contextlib.contextmanager
    def _api_call(self, what: str, lock: bool = True) -> Iterator[None]:
        """Hold the API lock (``lock``) and mark this thread as inside ``what``. A call made
        on a thread already inside save(), close(), load(), prepare() or wait() is a signal
        handler that interrupted one: it would run over (or deadlock on) the half-done
        call's locks - a save() inside load() would even take a half-restored state - so it
        is refused at once, naming the pattern that works. Calls these make themselves go
        through the unmarked halves (``_save``, ``_close``, ``_wait``)."""
        me = threading.get_ident()
        outer = self._api_threads.get(me)
        if outer is not None:
            raise CheckpointError(
                f"{what} was called inside {outer} on the same thread: a signal handler that interrupted it (it "
                f"cannot finish before the handler returns). In the handler, set a flag and save from the training "
                f"loop at its next step, then close()")
        with self._api if lock else contextlib.nullcontext():
            self._api_threads[me] = what
            try:
                yield
            finally:
                del self._api_threads[me]

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """Drain every save in flight, stop the background threads, unmap the slots. In a
        forked child of the process that made it, nothing: its threads, writer and job
        store are the parent's (a child leaving a with-block checked the parent's rank out
        of the job store, and every later save of the job failed)."""
        if os.getpid() != self._pid:
            return
        with self._api_call("close()"):
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.slot_timeout_s  # close()'s wait for uploads, all of it
        try:
            self._wait()
            deadline = time.monotonic() + self.config.slot_timeout_s  # from the last save's end
            try:
                catch_up(self, deadline)  # the tier lacks the newest durable step: it goes now
            except Exception as exc:  # noqa: BLE001 - never close()'s failure
                log.warning("incluster: rank %d: close() could not upload the newest step to the persistent tier: "
                            "%s: %s", self.rank, type(exc).__name__, exc)
        finally:
            self._closed = True
            self._guard.close()
            self._hand_over_queued(deadline)
            stuck = not self._staging_idle(self.config.slot_timeout_s)
            self._stage_pool.shutdown(wait=not stuck)
            with self._lock:
                uploading = sorted(step for _, step in self._uploads)
            if uploading:
                log.info("incluster: rank %d: close() waits for the persistent upload of step(s) %s (up to %.0f s, "
                         "slot_timeout_s)", self.rank, uploading, self.config.slot_timeout_s)
            with self._writer_lock:  # not while a dead writer's successor is starting
                self._writer.close(max(1.0, deadline - time.monotonic()))
            with self._lock:
                left = list(self._uploads)
            for timeline, step in left:  # never left pending: the writer is gone
                self._persisted(step, f"the upload had not finished when close() ended it (after up to "
                                      f"{self.config.slot_timeout_s:.0f} s, slot_timeout_s)", timeline)
            if not stuck:  # a staging thread still copying keeps its mappings: unmapping would crash it
                self.ring.close()
                self._stager.release_device()  # the device-side snapshot's GPU memory goes back
            if not self._checked_out:  # once per rank: twice would let rank 0 end the store under the others
                wiring.release_store(self._store_server, self._store_address, self.config, self.rank,
                                     self.world_size, (self._loads, self._last_step))
            self._store_server = None
            self.events.record(ev.END, seconds=time.perf_counter() - t0)  # saves and uploads drained: not training
            self.events.close()
            self._claim.release()

    def _staging_idle(self, timeout: float) -> bool:
        """Wait (bounded) until the staging thread has finished what it was given."""
        try:
            self._stage_pool.submit(lambda: None).result(timeout)
            return True
        except RuntimeError:  # the interpreter is exiting: its pools' threads were joined already
            return True
        except TimeoutError:
            log.warning("incluster: rank %d: the staging thread is still busy after %.0f s; closing without "
                        "it (its slot files stay mapped until the process ends)", self.rank, timeout)
            return False

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the body's own exception goes on: a failed save is logged, never put in its place
            self.close()
        except Exception as err:  # noqa: BLE001 - said, and the body's exception is what the caller sees
            log.error("incluster: rank %d: close() on leaving the with-block (which raised %s) also failed: "
                      "%s: %s", self.rank, exc_type.__name__, type(err).__name__, err)

