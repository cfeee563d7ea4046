"""The background half of a save, after ``save()`` returned: staging, hand-off to the
writer, and every outcome (committed here, durable on every rank, uploaded, failed).

Runs on the staging thread and on the writer's reply threads; the trainer thread only
ever sees the futures on the :class:`~incluster.handle.SaveHandle`. A failure anywhere
releases the slot, tells the other ranks (unless the writer already did) and reaches the
caller once, wrapped with what to do.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import functools
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any

from incluster.config import Config
from incluster.commit import Outcome, StoreCoordinator, failed_on
from incluster.errors import (CheckpointError, CommitError, PeerTimeoutError, StoreLostError, TierUnavailableError,
                              WriterProcessDied)
from incluster.goodput import events as ev
from incluster.guard import ClonePool
from incluster.handle import SaveHandle
from incluster.handover import SUPERSEDED, HandOver
from incluster.catch_up import not_due
from incluster.replication import PARTNER_GONE, PARTNER_NEW
from incluster.staging.engine import StageJob, Stager, gpu_devices
from incluster.staging.slots import Slot, SlotRing, SlotState, sidecar_file, step_file
from incluster.testing import faults
from incluster.writer.base import Writer
from incluster.writer.local_commit import CommitRequest
from incluster.writer.protocol import WriterParams
from incluster.writer.sequence import NO_MORE, SAME_STEPS
from incluster.writer_keeping import MAX_WRITER_RESTARTS, WriterKeeping

log = logging.getLogger("incluster")
EARLY_WORDS = 64  # upload outcomes kept for saves whose commit is not handled yet
_NO_WORD = object()


def _sidecar_of(folder: str, step: int, job: StageJob) -> bool:
    """Whether the commit record of ``step`` on disk is this save's (not a stale one)."""
    from incluster.format.sidecar import read_sidecar

    try:
        sc = read_sidecar(os.path.join(folder, sidecar_file(step)))
    except (OSError, CheckpointError):
        return False
    return job.layout is not None and sc.fingerprint == job.layout.fingerprint and sc.checksum.size == job.layout.total_size


def _cause_of(text: str) -> str:
    """What a failure says, its step numbers left out; a partner's writer gone for good is
    one cause however it was found (its own refused save, or the replica exchange)."""
    m = (re.search(r"rank \[(\d+)\]'s " + PARTNER_GONE, text)
         or re.search(r"save\(\) raised on rank (\d+): WriterProcessDied", text))
    return f"writer of rank {m.group(1)} gone" if m else re.sub(r"\bsteps? \d+", "step", text)


def own_error(err: BaseException, step: int) -> BaseException:
    """``err`` for step ``step`` alone: one error shared by several steps (a writer's death
    fails every save it held) is copied for each after the first, so a note added to one
    step's error (wait() naming the later failures) never shows on another's."""
    owner = getattr(err, "incluster_step", None)
    if owner is None or owner == step:
        with contextlib.suppress(AttributeError, TypeError):
            err.incluster_step = step  # type: ignore[attr-defined]
        return err
    try:
        dup = copy.copy(err)
    except Exception:  # noqa: BLE001 - an exception that cannot be rebuilt is shared as it is
        return err
    dup.__dict__.update({k: list(v) for k, v in err.__dict__.items() if k == "__notes__"})
    dup.incluster_step = step  # type: ignore[attr-defined]
    dup.__cause__, dup.__context__ = err.__cause__, err.__context__
    dup.__suppress_context__ = err.__suppress_context__
    return dup.with_traceback(err.__traceback__)


class SavePipeline(WriterKeeping):
    """Mixin of :class:`~incluster.checkpointer.Checkpointer`: what happens to a save
    once the trainer has handed it over."""

    config: Config
    rank: int
    world_size: int
    folder: str
    ring: SlotRing
    events: Any
    _stager: Stager
    _writer: Writer
    _lock: threading.Lock
    _uploads: dict[tuple[int, int], tuple[Slot, SaveHandle]]
    _newest_due_word: tuple[int, int, SaveHandle] | None
    _candidates: "collections.deque[tuple[int, int, SaveHandle]]"
    _newest_durable: tuple[int, int, SaveHandle] | None
    _early_persisted: dict[tuple[int, int], str | None]
    _loaded: bool
    _errors: list[tuple[SaveHandle, BaseException]]
    _warned_warm: bool
    _said_superseded: bool  # a save given up for a newer one while the writer started: warned once
    _given_up: bool  # some step was (here or on another rank): its upload may be the one the tier lacks
    _writer_params: WriterParams
    _peer_cause: str | None = None  # the last other rank's failure warned of (its step numbers left out)
    _peer_repeats = 0  # how many steps in a row failed for it since (a durable step ends the run)
    _shrunk_to: int | None  # the fewest slots the ring was cut to for want of room (the user was told)
    _closed: bool
    _stage_pool: Any
    _handover: HandOver
    _clones: ClonePool

    def _stage(self, job: StageJob, handle: SaveHandle) -> None:
        """Staging thread: copy, then hand the slot to the writer."""
        try:
            faults.check("stage", self.rank, job.step)
            self._stager.run(job)
            if job.flat is None or job.layout is None:
                raise CommitError(f"staging of step {job.step} produced no layout")
            req = CommitRequest(
                folder=self.folder,
                slot=job.slot.index,
                staging_path=job.slot.path,
                size=job.layout.total_size,
                job=self.config.job,
                step=job.step,
                rank=self.rank,
                world_size=self.world_size,
                node=self.config.node,
                fingerprint=job.layout.fingerprint,
                tree=job.flat.tree,
                fsync=self.config.fsync,
                ordinal=job.ordinal,
                prev=job.prev,
                timeline=job.timeline,
                digests=tuple(job.digests) if job.digests is not None else None,
                drain=job.drain,
                loaded=self._loaded,
                lineage=job.lineage,
                persist=job.persist,
                maps=job.slot.maps,
            )
        except BaseException as exc:  # noqa: BLE001 - reported through the futures
            self._fail(job, handle, exc, "staging")
            return
        job.mark_staged()
        handle.staged_s = (job.staged_at or time.perf_counter()) - handle.started
        self.events.record(ev.STAGED, step=job.step, seconds=handle.staged_s)
        self.ring.set_state(job.slot, SlotState.COMMITTING)
        # The next save may be staged before the writer's start is over (see handover).
        self._handover.run(functools.partial(self._submit, job, handle, req), key=(job, handle))
        # Right after each save is staged, on this thread: the other slots are ready
        # (sized, mapped, page-locked) before the next save takes one.
        self._warm(job.layout)

    def _submit(self, job: StageJob, handle: SaveHandle, req: CommitRequest) -> None:
        """Staging thread, once the writer's start is over: hand the staged save over."""
        self._writer_answered()
        writer = self._writer
        try:
            writer = self._live_writer()
            local, outcome = writer.submit(req, job.slot)
        except BaseException as exc:  # noqa: BLE001
            self._fail(job, handle, exc, "commit", writer=writer)
            return

        def on_local(f: "Future[tuple[str, bool]]") -> None:
            self._local_done(job, handle, f)  # always before the outcome is handled
            outcome.add_done_callback(lambda g: self._outcome(job, handle, g, writer))

        # The writer may have committed, and even ended (or skipped) the step's upload,
        # before this line: _persisted keeps such an early word for _local_done.
        faults.check("handoff", self.rank, job.step)
        local.add_done_callback(on_local)
        self._stager.offer_remote()  # a new writer, or a new buffer: shared before the next save

    def _local_done(self, job: StageJob, handle: SaveHandle, fut: "Future[tuple[str, bool]]") -> None:
        if fut.exception() is None:
            path, persist = fut.result()
            if persist:
                newest = self._newest_due
                if newest is None or (job.timeline, job.step) > newest[:2]:
                    self._candidates.append((job.timeline, job.step, handle))
                handle.persisted.add_done_callback(functools.partial(self._due_word, (job.timeline, job.step), handle))
                with self._lock:  # pinned and unpinned under this lock: never pinned after its upload ended
                    early = self._early_persisted.pop((job.timeline, job.step), _NO_WORD)
                    if early is _NO_WORD:
                        self._uploads[(job.timeline, job.step)] = (job.slot, handle)
                        self.ring.set_uploading(job.slot, True)
                if early is not _NO_WORD:
                    self._report_persisted(job.step, handle, early)  # type: ignore[arg-type]
            else:
                handle.persisted.set_result(False)
            self.ring.mark_committed(job.slot, job.step, path)
            handle.committed_s = time.perf_counter() - handle.started
            remote = self._stager.remote
            drained = remote.drained_at(job.step) if job.drain is not None and remote is not None else None
            if drained is not None:
                handle.drained_s = drained - handle.started
            self.events.record(ev.DURABLE, step=job.step, tier="local", seconds=handle.committed_s)

    def _outcome(self, job: StageJob, handle: SaveHandle, fut: "Future[None]", writer: Writer) -> None:
        exc = fut.exception()
        if isinstance(exc, WriterProcessDied):
            if not self._settle_orphan(job, handle, exc):
                self._fail(job, handle, exc, "commit", published=True, writer=writer)
                return
        elif isinstance(exc, StoreLostError):
            self._outcome_unknown(job, handle, exc)
            return
        elif exc is not None:  # the writer published its own failures
            self._fail(job, handle, exc, "commit", published=True, writer=writer)
            return
        self.ring.set_global(job.step)
        self.ring.drop_unheld(job.step)
        if self._newest_durable is None or (job.timeline, job.step) > self._newest_durable[:2]:
            self._newest_durable = (job.timeline, job.step, handle)
        handle.durable_s = time.perf_counter() - handle.started
        if self.world_size > 1:
            self.events.record(ev.DURABLE, step=job.step, tier="global", seconds=handle.durable_s)
        self._peer_cause = None  # a durable step ends a run of failures: the next one is warned of again
        handle.durable.set_result(None)

    def _outcome_unknown(self, job: StageJob, handle: SaveHandle, exc: BaseException) -> None:
        """The job store went away (rank 0's process died) before ``job.step``'s outcome
        was known here. It may be durable on every rank: rank 0 may have seen it so and
        told its caller. Un-committing this rank's copy (and the replicas held here) would
        lose a step reported durable, so both stay; a restart's load() takes the step
        only if every rank's copy of it is found."""
        err = PeerTimeoutError(
            f"step {job.step} is committed on this rank, but the job store went away (rank 0's process ended?) "
            f"before its outcome was known: {exc}. This node keeps its copies of it; a restart restores it "
            f"if every rank's copy is found, else the step before")
        err.from_peer = True  # type: ignore[attr-defined]
        log.warning("incluster: rank %d: %s", self.rank, err)
        self._tell_failed(job, handle, err)  # the slot stays committed: no ring.fail

    def _settle_orphan(self, job: StageJob, handle: SaveHandle, exc: BaseException) -> bool:
        """The writer died with ``job.step`` in flight. It may have committed the step here
        and counted it - even completed it on every rank - before it could say so: decide
        the step once for every rank. True: it is durable after all (this rank keeps it, as
        every other rank does); False: it is now published failed, so no rank waits for it."""
        step, reason = job.step, f"commit: {type(exc).__name__}: {exc}"
        final = os.path.join(self.folder, step_file(step))
        on_disk = os.path.exists(final) and _sidecar_of(self.folder, step, job)  # the sidecar is written last
        store = self._writer_params.store
        if store is None:
            durable = on_disk  # one rank: its local commit is the global one
        else:
            try:
                coord = StoreCoordinator(store, self.rank, timeout=10).at(job.timeline)
                durable = coord.settle(step, reason) == Outcome.COMMITTED.value
            except Exception:  # noqa: BLE001 - the store is gone too: the other ranks time out instead
                return False
            if durable and not on_disk:  # counted only after the commit: cannot happen
                log.error("incluster: rank %d: step %d is complete on every rank but its copy here is "
                          "missing; a restore takes it from a replica if there is one", self.rank, step)
                return False
        if not durable:
            return False
        if job.slot.step == step and job.slot.state is not SlotState.COMMITTED:
            self.ring.mark_committed(job.slot, step, final)
            handle.committed_s = time.perf_counter() - handle.started
            self.events.record(ev.DURABLE, step=step, tier="local", seconds=handle.committed_s)
        if not handle.persisted.done() and (job.timeline, step) not in self._uploads:
            with contextlib.suppress(InvalidStateError):
                handle.persisted.set_result(False)  # no upload was started for it
        log.warning("incluster: rank %d: the writer died after committing step %d; the step is durable", self.rank, step)
        return True

    def _persisted(self, step: int, err: str | None, timeline: int = 0) -> None:
        """The writer finished (or skipped) a persistent upload of the save of ``step``
        after ``timeline`` load() calls: unpin its slot, report. Its word may come before
        the step's commit was handled here (a skip is told right after the commit): it is
        then kept for ``_local_done``."""
        key = (timeline, step)
        self._uploaded = self._uploaded or err is None
        with self._lock:
            slot, handle = self._uploads.pop(key, (None, None))
            if slot is not None:
                self.ring.set_uploading(slot, False)
            elif key not in self._early_persisted:
                self._early_persisted[key] = err
                while len(self._early_persisted) > EARLY_WORDS:  # words no save claimed: the oldest go
                    self._early_persisted.pop(min(self._early_persisted))
        if handle is not None:
            self._report_persisted(step, handle, err)

    @property
    def _newest_due(self) -> tuple[int, int, SaveHandle] | None:
        """(timeline, step, handle) of the newest save whose upload was due (or, with
        ``persistent_interval_s``, a candidate): the newest of the candidates kept."""
        return self._candidates[-1] if self._candidates else None

    def _due_word(self, key: tuple[int, int], handle: SaveHandle, fut: "Future[bool]") -> None:
        """A candidate's upload word came: unless it says "not due" (``persistent_interval_s``
        decides only when the upload would start), it is the newest due save so far. close()'s
        catch-up looks there when the newest candidate was not due: a due save skipped for a
        running upload, followed by saves inside the interval, left the tier behind."""
        if not_due(handle):
            return
        with self._lock:
            if self._newest_due_word is None or key > self._newest_due_word[:2]:
                self._newest_due_word = (*key, handle)

    def _report_persisted(self, step: int, handle: SaveHandle, err: str | None) -> None:
        if handle.persisted.done():  # told twice (close() resolving what a late word also resolves)
            return
        if err is None:
            self.events.record(ev.DURABLE, step=step, tier="persistent", seconds=time.perf_counter() - handle.started)
            handle.persisted.set_result(True)
        elif err.startswith("skipped"):
            self.events.record(ev.PERSIST_FAILED, step=step, error=err, skipped=True)
            handle.skip_word = err
            handle.persisted.set_result(False)
        else:
            self.events.record(ev.PERSIST_FAILED, step=step, error=err, skipped=False)
            handle.persisted.set_exception(
                TierUnavailableError(f"step {step} did not reach the persistent tier {self.config.persistent}: {err}")
            )

    def _fail(
        self,
        job: StageJob,
        handle: SaveHandle,
        exc: BaseException,
        phase: str,
        published: bool = False,
        writer: Writer | None = None,
    ) -> None:
        if not published:  # no rank may wait for a step that failed here (told by the step's own writer)
            reason, seq = f"{phase}: {type(exc).__name__}: {exc}", (job.prev, job.ordinal, job.timeline)
            # behind the saves still waiting for the writer's start (the steps' order)
            self._handover.run(lambda: (writer or self._writer).fail(job.step, reason, seq))
        full = getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)
        hint = (f"; the RAM disk holding {self.folder} is full: free space there, lower keep or "
                f"replicas, or point local_dir elsewhere") if full and "free space" not in str(exc) else ""
        err = exc if isinstance(exc, CheckpointError) and not hint else CommitError(
            f"saving step {job.step} failed during {phase}: {type(exc).__name__}: {exc}; "
            f"the previous committed step is intact{hint}"
        )
        if err is not exc:
            err.__cause__ = exc
        peer = published and phase == "commit" and (
            isinstance(exc, PeerTimeoutError) or failed_on(str(exc)) not in (None, self.rank)
            or "(replication: " in str(exc) or PARTNER_NEW in str(exc) or PARTNER_GONE in str(exc)  # a pair's
            # a step only some ranks saved: raised by the next save(), it would fail that step everywhere too
            or SAME_STEPS in str(exc) or NO_MORE in str(exc))
        if peer:  # another rank's failure: reported by wait() and the handle, never by this rank's next save()
            err.from_peer = True  # type: ignore[attr-defined]
            self._say_peer_failure(err)
        if job.drain is not None and self._stager.remote is not None:
            self._stager.remote.done(job.step)  # a failed drain stopped reading; a dead writer reads nothing
        self.ring.fail(job.slot, job.step)  # one locked transition: no save can take it half way
        try:
            self._fit_ring(exc, job.layout.total_size if job.layout is not None else 0)
        except Exception as fit_exc:  # noqa: BLE001 - the save's own failure must still reach its handle
            log.warning("incluster: rank %d could not leave the slots without room out: %s", self.rank, fit_exc)
        self._tell_failed(job, handle, err)

    def _say_peer_failure(self, err: BaseException) -> None:
        """Warn of a step another rank failed; the same cause for the next steps (a rank
        that saves no more fails every later step) is said once more, then at INFO until a
        step is durable again."""
        cause = _cause_of(str(err))
        repeats = self._peer_repeats + 1 if cause == self._peer_cause else 0
        self._peer_cause, self._peer_repeats = cause, repeats
        if repeats == 0:
            log.warning("incluster: rank %d: %s", self.rank, err)
        elif repeats == 1:
            log.warning("incluster: rank %d: %s (as the step before; later steps failed for this reason are "
                        "logged at INFO until a step is durable again; wait() and their handles still raise)", self.rank, err)
        else:
            log.info("incluster: rank %d: %s", self.rank, err)

    def _tell_failed(self, job: StageJob, handle: SaveHandle, err: BaseException) -> None:
        """Report ``job.step`` as not durable: the event, wait()'s error, the handle."""
        err = own_error(err, job.step)
        # A step given up for a newer one (here or on another rank): not a failure of the
        # checkpointing, counted apart by the goodput report.
        given_up = {"superseded": True} if SUPERSEDED in str(err) else {}
        if given_up:  # on every rank alike (a FAIL with the marker): close() catches the tier up (catch_up.py)
            self._given_up = True
        self.events.record(ev.SAVE_FAILED, step=job.step, error=str(err), **given_up)
        with self._lock:
            self._errors.append((handle, err))
        for fut in (job.staged, handle.durable):
            if not fut.done():
                fut.set_exception(err)
        if not handle.persisted.done() and (job.timeline, job.step) not in self._uploads:
            with contextlib.suppress(InvalidStateError):  # an upload's word may resolve it meanwhile
                handle.persisted.set_result(False)
        job.host_done.set()

    def _fit_ring(self, exc: BaseException, size: int) -> bool:
        """A new slot got no RAM (``exc``): keep as many steps as the RAM disk holds,
        saying so once, so later saves reuse the slots that have room (the newest
        committed step always stays) rather than failing on the empty one. True when the
        ring was made smaller."""
        if not getattr(exc, "no_room", False):
            return False
        asked = self.ring.keep
        fits = self.ring.leave_out_unallocated()
        if fits is None:
            return False
        # Said when the ring is smaller than ever before; a slot grown back that found no room after all: INFO
        told = self._shrunk_to is not None and fits >= self._shrunk_to
        self._shrunk_to = fits if self._shrunk_to is None else min(self._shrunk_to, fits)
        log.log(logging.INFO if told else logging.WARNING,
                "incluster: rank %d: the RAM disk holding %s has no room for %d checkpoint slots of %.1f MiB; keeping "
                "%d from now on (each save reuses the oldest; the others come back once there is room); lower keep "
                "(or replicas), free space there, or point local_dir elsewhere",
                self.rank, self.folder, asked, size / 2**20, fits)
        return True

    def _warm(self, layout: Any) -> None:
        """Staging thread, off the training path: create the slots the ring still lacks and
        make every free one ready for ``layout`` (sized, mapped, headed, page-locked when
        saves are on a GPU). Slots holding a committed step keep their bytes; the one the
        next save takes is only mapped (and page-locked)."""
        try:
            if self.ring.grow_back(layout.total_size):
                log.info("incluster: rank %d: the RAM disk has room again for a checkpoint slot; keeping %d of the %d "
                         "steps asked for", self.rank, self.ring.keep, self.ring.asked)
            while self.ring.acquire_new() is not None:  # keep (+1 with a persistent tier)
                pass
            for slot in self.ring.free_slots():
                self._stager.ready(slot, layout)
            # After a restart every slot may hold a step: the one the next save takes over
            # is mapped (and page-locked) now, not on that save's path.
            ahead = self.ring.next_taken(layout.total_size)
            if ahead is not None:
                self._stager.map_ahead(ahead, layout.total_size)
            self._stager.pin_remote()
        except Exception as exc:  # noqa: BLE001 - warming is an optimisation only
            if self._fit_ring(exc, layout.total_size):
                return
            if not self._warned_warm:
                self._warned_warm = True
                log.warning("incluster: could not prepare checkpoint slots ahead of the next save: %s", exc)

    def _prepare(self, snap: Any, device: bool = True, clone_shapes: list[Any] | None = None) -> None:
        """Staging thread: ``Checkpointer.prepare`` (``device``: also the device-side
        snapshot buffer; not when ``load()`` prepares, before training has shown how much
        GPU memory it needs; ``clone_shapes``: the save-time copies to make ahead)."""
        if clone_shapes:
            self._clones.warm(clone_shapes)
        flat = self._stager.flattener.flatten(snap)
        layout = self._stager.layouts.get(tuple(flat.specs))
        if device:
            self._stager.prepare_for(flat.tensors, layout)
        else:
            gpu = [t for t in flat.tensors if t.is_cuda]
            if gpu:
                self._stager.pin_for(gpu[0])
                self._stager.cuda_devices = gpu_devices(gpu)
        self._warm(layout)
        self._stager.offer_remote()
