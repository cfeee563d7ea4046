"""The trainer's side of its writer process's life: a writer that died is replaced (at
most ``MAX_WRITER_RESTARTS`` times per Checkpointer), its replication partners are told
which incarnation comes next or that none will, and a rank whose writer is gone for good
refuses its saves, saying why."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from incluster.config import Config
from incluster.errors import WriterProcessDied
from incluster.store_client import LOST_STORE, refused
from incluster.replication import announce_writer
from incluster.writer.base import Writer
from incluster.writer.process import ProcessWriter, next_generation
from incluster.writer.protocol import WriterParams
from incluster.writer.spawner import writer_spawner

log = logging.getLogger("incluster")
MAX_WRITER_RESTARTS = 3  # per Checkpointer: a writer that keeps dying has a cause to find


class WriterKeeping:
    """Mixed into the Checkpointer (through ``SavePipeline``)."""

    config: Config
    rank: int
    _stager: Any
    _writer: Writer
    _lock: threading.Lock
    _uploads: dict[tuple[int, int], Any]
    _writer_params: WriterParams
    _writer_lock: threading.Lock
    _writer_restarts: int
    _uploaded = False  # a step of this run reached the persistent tier (a new writer keeps the job's record)
    _closed: bool
    _stage_pool: Any
    _restarting = False  # _live_writer is starting a successor
    _store_refused: bool | None = None  # the job store refused a connection (asked once, _store_gone)

    _persisted: Callable[..., None]  # SavePipeline's: an upload's outcome (here: one the dead writer left)
    def _writer_died(self) -> None:
        """The writer process is gone: start its successor now, in the background, so it
        is paired with the replication partners before the next save reaches it."""
        if self._closed:
            return
        # At once, so replication partners wait for the new writer instead of failing steps.
        self._announce("gone" if self._writer_restarts >= MAX_WRITER_RESTARTS else f"restarting {self._writer_restarts + 1}")

        def replace() -> None:
            try:
                self._live_writer()
            except Exception as exc:  # noqa: BLE001 - the next save reports it
                log.warning("incluster: rank %d: %s", self.rank, exc)

        try:
            self._stage_pool.submit(replace)
        except RuntimeError:  # shutting down
            pass

    def _live_writer(self) -> Writer:
        """The writer; if its process died, a new one takes its place (at most
        ``MAX_WRITER_RESTARTS`` times per Checkpointer). Saves that were in flight are
        lost - the dead writer's rank already reported them failed - and every later save
        goes to the new writer, which pairs again with this rank's replication partners."""
        with self._writer_lock:
            dead = getattr(self._writer, "dead", None)
            if dead is None or self._closed:
                return self._writer
            gone = self._writer_gone()
            if gone is not None:
                raise gone
            self._restarting = True  # first: the last restart is under way, not gone yet (_writer_gone)
            self._writer_restarts += 1
            with self._lock:
                uploads = list(self._uploads)
            for timeline, step in uploads:  # their slots must not stay pinned for an upload that is gone
                self._persisted(step, "the writer process died during the upload", timeline)
            log.warning(
                "incluster: rank %d: %s; starting a new writer process (%d of at most %d restarts)",
                self.rank, dead, self._writer_restarts, MAX_WRITER_RESTARTS,
            )
            old = self._writer
            params = dataclasses.replace(self._writer_params, gen=next_generation(), incarnation=self._writer_restarts)
            if params.persist is not None and self._uploaded:  # the run's record is its own: the fence holds
                params = dataclasses.replace(params, persist=dataclasses.replace(params.persist, owned=True))
            try:
                self._writer = writer_spawner().submit(
                    ProcessWriter, params, on_persisted=self._persisted, on_death=self._writer_died
                ).result()
                self._writer.drain_listener = self._stager.remote  # type: ignore[attr-defined]
            except BaseException:
                # Partners wait for the announced incarnation: say which comes next, or that none will.
                done = self._writer_restarts >= MAX_WRITER_RESTARTS
                self._announce("gone" if done else f"restarting {self._writer_restarts + 1}")
                raise
            finally:
                self._restarting = False
            old.close(1.0)
            for folder, step in getattr(old, "unsent_replicates", ()):  # a restored step's replicas
                self._writer.replicate(folder, step)
            return self._writer

    def _tell_writer_failed(self, step: int, reason: str, seq: tuple[int, int, int]) -> None:
        """Tell the writer that ``step`` failed (the other ranks hear it from there); a
        writer gone for good, or one whose successor cannot start, publishes it from this
        process (``ProcessWriter.fail`` on a dead one)."""
        try:
            writer = self._writer if self._writer_gone() is not None else self._live_writer()
        except Exception:  # noqa: BLE001 - no successor: the dead writer's fail() publishes from here
            writer = self._writer
        writer.fail(step, reason, seq)

    def _writer_answered(self) -> None:
        """Staging thread, before a save is handed to the writer: the writer's start is
        over (neither the constructor nor load() waits for it; ``_handover`` runs the
        hand-off only then, so this does not wait). A save is then never held by a writer
        whose start fails: ``_live_writer`` hands it to the next one."""
        wait = getattr(self._writer, "wait_started", None)
        if wait is None:
            return
        try:
            wait()  # bounded: the start's own handshake timeout ends it
        except Exception:  # noqa: BLE001 - it died starting: the next one takes the save
            pass

    def _writer_gone(self) -> WriterProcessDied | None:
        """Why this rank saves no more: its writer died after its last restart; else None."""
        dead = getattr(self._writer, "dead", None)
        if dead is not None and not self._restarting and LOST_STORE in str(dead) and self._store_gone():
            return WriterProcessDied(f"{dead}. A new writer would find the job store gone too: none is started")
        if dead is None or self._writer_restarts < MAX_WRITER_RESTARTS or self._restarting:
            return None  # alive, or its last successor is starting (the dead one is still self._writer)
        return WriterProcessDied(
            f"{dead}. It was started again {self._writer_restarts} times in this job and is not "
            f"started again: look for what kills it (its stderr, the kernel log: out of memory?), "
            f"then restart the job - it resumes from the newest complete step")

    def _store_gone(self) -> bool:
        """The job store refuses connections (rank 0's process is gone), asked once: a
        writer that died of a connect that timed out (a store alive but slow) is started
        again as usual."""
        if self._store_refused is None:
            store = self._writer_params.store
            self._store_refused = store is not None and refused(store.host, store.port) is not None
        return self._store_refused

    def _announce(self, state: str) -> None:
        params = self._writer_params
        if params.store is None or not (params.targets or params.sources):
            return  # no replication partner waits for this writer
        try:
            announce_writer(params.store, params.job, self.rank, state)
        except Exception as exc:  # noqa: BLE001 - they then fail a step or two instead
            log.warning("incluster: rank %d could not tell its partners about its writer: %s", self.rank, exc)
