"""Checkpointer: the trainer-side orchestrator. Thin: it wires the parts together.

save:  snapshot (trainer thread, ~ms) -> slot ring -> Stager (staging thread: flatten,
       layout, copy) -> Writer (checksum, rename, sidecar) -> durable.
load:  newest committed step in this rank's folder -> verify -> copy in place; a corrupt
       step is discarded with a warning and the next older one is tried.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import torch

from incluster import config as _config
from incluster.errors import CheckpointError, CommitError, CorruptCheckpointError, PeerTimeoutError
from incluster.format.sidecar import Sidecar
from incluster.goodput import events as ev
from incluster.handle import SaveHandle
from incluster.staging.engine import StageJob, Stager
from incluster.staging.slots import Slot, SlotRing, SlotState, sidecar_file, step_file
from incluster.state import load_into, snapshot
from incluster.tiers.local import ShardReader, committed_steps, rank_folder
from incluster.writer.local_commit import CommitRequest
from incluster.writer.thread import ThreadWriter

log = logging.getLogger("incluster")


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Checkpointer:
    """Asynchronous, rank-local checkpoints in the node's RAM disk.

    >>> ckpt = Checkpointer(local_dir="/dev/shm/incluster", job="run-7")
    >>> start = ckpt.load(state)            # newest complete step, or None
    >>> handle = ckpt.save(step, state)     # returns at once; copies run in background
    >>> ckpt.close()
    """

    def __init__(self, **options: Any) -> None:
        self.config = _config.resolve(**options)
        self.rank, self.world_size = _rank_world()
        self.folder = rank_folder(self.config.local_dir, self.config.job, self.rank)
        os.makedirs(os.path.dirname(self.folder), mode=0o700, exist_ok=True)
        self.ring = SlotRing(self.folder, self.config.keep, on_unmap=self._on_unmap)
        self._stager = Stager(self.ring, self.config.allow_pickle)
        self._stage_pool = ThreadPoolExecutor(1, thread_name_prefix="incluster-stage")
        self._writer = ThreadWriter()
        self._inflight: StageJob | None = None
        self._pending: list[SaveHandle] = []
        self._errors: list[tuple[SaveHandle, BaseException]] = []
        self._hooks: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._warmed = False
        self.events: ev.EventRecorder | ev.NullRecorder = (
            ev.EventRecorder(self.config.run_dir, self.rank) if self.config.run_dir else ev.NULL_RECORDER
        )
        self.events.record(ev.START, world_size=self.world_size, node=self.config.node)

    # -- saving -----------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns once the state may be used again
        by forward/backward. Tensors may not be mutated until ``handle.staged`` (the
        optimizer pre-step hook waits for it automatically)."""
        t0 = time.perf_counter()
        self._check_usable()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int (got {step!r})")
        snap, optimizers = snapshot(state, allow_pickle=self.config.allow_pickle)
        for opt in optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._pre_step_hook)
        slot = self.ring.acquire(step, self.config.slot_timeout_s)
        job = StageJob(step=step, snap=snap, slot=slot)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            from incluster.staging import cuda

            job.cuda_start = cuda.record_start()
        handle = SaveHandle(step=step, staged=job.staged, started=t0)
        with self._lock:
            self._inflight = job
            self._pending.append(handle)
        self._stage_pool.submit(self._stage, job, handle)
        handle.blocked_s = time.perf_counter() - t0
        self.events.record(ev.SAVE, step=step, blocked_s=handle.blocked_s)
        return handle

    def record_step(self, step: int) -> None:
        """Mark training progress (cheap, buffered) so goodput reports can tell exactly
        how much work a failure cost. Optional."""
        self.events.record(ev.TRAIN_STEP, step=step)

    def _stage(self, job: StageJob, handle: SaveHandle) -> None:
        """Staging thread: copy, then hand the slot to the writer."""
        try:
            self._stager.run(job)
            if job.flat is None or job.layout is None:
                raise CommitError(f"staging of step {job.step} produced no layout")
            req = CommitRequest(
                folder=self.folder,
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
            )
        except BaseException as exc:  # noqa: BLE001 - reported through the futures
            self._fail(job, handle, exc, "staging")
            return
        handle.staged_s = time.perf_counter() - handle.started
        self.events.record(ev.STAGED, step=job.step, seconds=handle.staged_s)
        self.ring.set_state(job.slot, SlotState.COMMITTING)
        job.staged.set_result(None)
        try:
            fut = self._writer.submit(req, job.slot)
        except BaseException as exc:  # noqa: BLE001
            self._fail(job, handle, exc, "commit")
            return
        fut.add_done_callback(lambda f: self._committed(job, handle, f))

    def _committed(self, job: StageJob, handle: SaveHandle, fut: "Future[tuple[str, Sidecar]]") -> None:
        exc = fut.exception()
        if exc is not None:
            self._fail(job, handle, exc, "commit")
            return
        path, _ = fut.result()
        self.ring.mark_committed(job.slot, job.step, path)
        self._drop_unheld(job.step)
        handle.durable_s = time.perf_counter() - handle.started
        self.events.record(ev.DURABLE, step=job.step, tier="local", seconds=handle.durable_s)
        handle.durable.set_result(None)
        if not self._warmed and job.layout is not None:
            self._warmed = True
            self._stage_pool.submit(self._warm, job.layout.total_size)

    def _fail(self, job: StageJob, handle: SaveHandle, exc: BaseException, phase: str) -> None:
        err = exc if isinstance(exc, CheckpointError) else CommitError(
            f"saving step {job.step} failed during {phase}: {type(exc).__name__}: {exc}; "
            f"the previous committed step is intact"
        )
        if err is not exc:
            err.__cause__ = exc
        final = os.path.join(self.folder, step_file(job.step))
        if os.path.exists(final) and not os.path.exists(os.path.join(self.folder, sidecar_file(job.step))):
            os.replace(final, job.slot.path if job.slot.path != final else final + ".torn")
        self.ring.release(job.slot)
        self.events.record(ev.SAVE_FAILED, step=job.step, error=str(err))
        with self._lock:
            self._errors.append((handle, err))
        for fut in (job.staged, handle.durable):
            if not fut.done():
                fut.set_exception(err)
        job.host_done.set()

    def _warm(self, size: int) -> None:
        """After the first commit: allocate and map the remaining slots off the hot path."""
        try:
            with self.ring._cond:
                missing = self.config.keep - len(self.ring.slots)
            for _ in range(missing):
                slot = self.ring.acquire_new()
                if slot is None:
                    return
                self.ring.prepare(slot, size)
                self.ring.release(slot)
        except Exception as exc:  # noqa: BLE001 - warming is an optimisation only
            log.warning("incluster: could not pre-allocate checkpoint slots: %s", exc)

    def _drop_unheld(self, newest: int) -> None:
        """Delete committed steps older than ``newest`` that no slot holds any more."""
        held = set(self.ring.committed_steps())
        for step in committed_steps(self.folder):
            if step < newest and step not in held:
                for name in (sidecar_file(step), step_file(step)):
                    try:
                        os.unlink(os.path.join(self.folder, name))
                    except FileNotFoundError:
                        pass

    def _pre_step_hook(self, *_: Any) -> None:
        """Optimizer pre-step: parameters must not change before the save's copy is done."""
        job = self._inflight
        if job is None or job.staged.done():
            return
        if not job.host_done.wait(self.config.slot_timeout_s):
            raise PeerTimeoutError(
                f"staging of step {job.step} did not finish within {self.config.slot_timeout_s:.0f} s; "
                f"the optimizer step cannot run before it (raise slot_timeout_s?)"
            )
        if job.cuda_done:
            from incluster.staging import cuda

            cuda.wait_on_compute(job.cuda_done)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the latest save's bytes are copied out; then tensors may change."""
        job = self._inflight
        if job is not None:
            job.staged.result(timeout if timeout is not None else self.config.slot_timeout_s)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is durable; raise the first background error."""
        with self._lock:
            pending = list(self._pending)
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.slot_timeout_s)
        for h in pending:
            try:
                h.durable.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise PeerTimeoutError(f"step {h.step} did not become durable in time") from None
            except BaseException:
                pass  # collected in self._errors, raised below
        with self._lock:
            self._pending = [h for h in self._pending if not h.durable.done()]
        self._raise_errors()

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        for handle, err in errors:
            if not handle.reported:
                handle.reported = True
                raise err

    def _check_usable(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")
        self._raise_errors()
        with self._lock:
            self._pending = [h for h in self._pending if not h.durable.done()]

    # -- loading ----------------------------------------------------------------------
    def load(self, state: Mapping[str, Any]) -> int | None:
        """Restore the newest complete step into ``state`` in place; its step, or None."""
        self._check_usable()
        self.wait()
        t0 = time.perf_counter()
        for step in committed_steps(self.folder):
            try:
                reader = ShardReader(self.folder, step)
            except CorruptCheckpointError as exc:
                log.warning("incluster: rank %d step %d is unusable (%s); trying an older step", self.rank, step, exc)
                self.ring.discard(step)
                continue
            with reader:
                self._check_identity(reader.sidecar)
                load_into(state, reader.sidecar.tree, reader.tensor, allow_pickle=self.config.allow_pickle)
            seconds = time.perf_counter() - t0
            log.info(
                "incluster: rank %d restored step %d from %s (%d bytes, %.3f s)",
                self.rank, step, self.folder, reader.nbytes, seconds,
            )
            self.events.record(ev.LOAD, step=step, source="local", bytes=reader.nbytes, seconds=seconds)
            return step
        self.events.record(ev.LOAD, step=None, source="none", bytes=0, seconds=time.perf_counter() - t0)
        return None

    def _check_identity(self, sc: Sidecar) -> None:
        if sc.job != self.config.job or sc.rank != self.rank:
            raise CorruptCheckpointError(
                f"{self.folder}: holds job {sc.job!r} rank {sc.rank}, expected job "
                f"{self.config.job!r} rank {self.rank}; the folder was copied or renamed"
            )
        if sc.world_size != self.world_size:
            raise CheckpointError(
                f"step {sc.step} was saved by {sc.world_size} ranks but this job has "
                f"{self.world_size}; resharding in place is not supported - assemble a full "
                f"state with `incluster export` and load that"
            )

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """Drain every save in flight, stop the background threads, unmap the slots."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for h in self._hooks.values():
                h.remove()
            self._hooks.clear()
            self._stage_pool.shutdown(wait=True)
            self._writer.close(self.config.slot_timeout_s)
            self.ring.close()
            self.events.record(ev.END)
            self.events.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def _on_unmap(slot: Slot) -> None:
        if slot.pinned:
            from incluster.staging import cuda

            cuda.unregister(slot)
