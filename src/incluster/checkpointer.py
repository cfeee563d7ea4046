"""Checkpointer: the trainer-side orchestrator. Thin: it wires the parts together.

save:  snapshot (trainer thread, ~ms) -> slot ring -> Stager (staging thread: flatten,
       layout, copy) -> Writer (checksum, rename, sidecar, count in the job store)
       -> durable once every rank committed the step (the background half: saving.py).
load:  the newest step every rank holds and can verify (restore.py) -> copy in place
       -> heal, replicas and slots in the background (loading.py).

IMPORTANT: the constructor and load() are collective when a process group with more
than one rank exists (every rank must call them); save() never is.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch

from incluster import config as _config
from incluster import launch, ramdisk, reserve, wiring
from incluster.claim import Claim, refuse_shared_folder
from incluster.commit import process_run
from incluster.errors import CheckpointError, PeerTimeoutError, TierUnavailableError
from incluster.goodput import events as ev
from incluster.closing import Teardown
from incluster.handle import SaveHandle
from incluster.early_saves import EarlySaves
from incluster.handover import HandOver
from incluster.loading import LoadPipeline
from incluster.saving import SavePipeline
from incluster.guard import ClonePool, StepGuard
from incluster.recovery.restore import RestoreReport
from incluster.reporting import ErrorReports, add_note
from incluster.replication import announce_writer
from incluster.staging.engine import StageJob, Stager
from incluster.staging.slots import Slot, SlotRing
from incluster.state import snapshot
from incluster.tiers.local import rank_folder
from incluster.writer.base import Writer
from incluster.writer.process import ProcessWriter, next_generation
from incluster.writer.protocol import WriterParams
from incluster.writer.spawner import writer_spawner
from incluster.writer.thread import ThreadWriter

log = logging.getLogger("incluster")


class Checkpointer(EarlySaves, SavePipeline, LoadPipeline, ErrorReports, Teardown):
    """Asynchronous, rank-local checkpoints in the node's RAM disk.

    >>> ckpt = Checkpointer(local_dir="/dev/shm/incluster", job="run-7")
    >>> start = ckpt.load(state)            # newest complete step, or None
    >>> handle = ckpt.save(step, state)     # returns at once; copies run in background
    >>> ckpt.close()
    """

    def __init__(self, **options: Any) -> None:
        _config.check_names(options, "Checkpointer()")
        self.config = _config.resolve(**options)
        self._job_derived = False  # rank 0: no job= or INCLUSTER_JOB, so the name came from the launch
        self._replicas_asked = "replicas" in options  # else the default: a shortfall is news, not a warning
        self._refuse_resize: str | None = None  # an integration's reason a step of another world size cannot go on
        self._left_out_ok = False  # an integration's load() leaves parts out on purpose (evaluation: no optimizers)
        self.rank, self.world_size = launch.rank_world()
        self.folder = rank_folder(self.config.local_dir, self.config.job, self.rank)
        if self.rank == 0:
            self._job_derived = launch.job_derived(options, self.config.job, self.world_size)
        if self.world_size == 1 and isinstance(options.get("replicas"), int) and options["replicas"] > 0:
            log.warning("incluster: replicas=%d asked for, but this job is one process: there is no other node to "
                        "hold a copy, so its checkpoints live in this node's RAM%s", options["replicas"],
                        " and the persistent tier" if self.config.persistent else
                        " only (add persistent= for a copy that outlives the node)")
        try:
            os.makedirs(os.path.dirname(self.folder), mode=0o700, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create this job's folder in local_dir {self.config.local_dir!r} ({exc.strerror or exc}: "
                f"{exc.filename or os.path.dirname(self.folder)}); point local_dir (or INCLUSTER_LOCAL_DIR) at a "
                f"folder this process can write, in the node's RAM disk (e.g. /dev/shm/incluster)"
            ) from exc
        if self.rank == 0:  # once the folder is known to be there: a path it cannot be made in gets only that error
            ramdisk.hint_once(self.config.local_dir)
        launch.refuse_links(os.path.dirname(self.folder), self.folder)
        self._claim = Claim(os.path.dirname(self.folder), self.config.job, self.rank, owner=self)  # one live run per job and rank
        try:
            self._start()
        except BaseException as exc:
            self._abandon(exc)  # nothing half-started outlives a failed __init__: a retry can claim again
            raise

    def _start(self) -> None:
        """The rest of ``__init__``, after this run claimed its job and rank."""
        reserve.ensure(reserve.reserve_path(os.path.dirname(self.folder), self.rank))  # see reserve.py
        # With a persistent tier the ring has one more slot: a slow upload never holds up saves.
        slots = self.config.keep + (1 if self.config.persistent else 0)
        self.ring = SlotRing(self.folder, slots, on_map=self._on_map, on_unmap=self._on_unmap)
        # Keyed (timeline, step): a step number saved again after a load() is another save,
        # whose word must not be taken for the upload of the one before it.
        self._uploads: dict[tuple[int, int], tuple[Slot, SaveHandle]] = {}
        # the newest saves whose upload was due (every save, with persistent_interval_s: words
        # that may come in any order say which were), newest last; and the newest whose word
        # said it was due (uploaded, skipped, failed; not "not due")
        self._newest_due_word: tuple[int, int, SaveHandle] | None = None
        self._candidates: collections.deque[tuple[int, int, SaveHandle]] = collections.deque(maxlen=64)
        self._newest_durable: tuple[int, int, SaveHandle] | None = None  # (timeline, step, handle)
        # close() uploads the newest durable step whenever the tier lacks it (catch_up.py);
        # without it, only when the newest due upload was skipped. The integrations set it.
        self.persist_last = False
        self._early_persisted: dict[tuple[int, int], str | None] = {}  # upload outcomes told before the commit was handled
        self._stager = Stager(self.ring, self.config.allow_pickle, self.config.gpu_snapshot)
        self._store_server, address, targets, sources, node_folders = wiring.start_store(
            self.config, self.rank, self.world_size, asked=self._replicas_asked)
        self._store_address = address
        if address is not None and self.world_size > 1:
            refuse_shared_folder(os.path.dirname(self.folder), self.rank, self.config.node, address.run)
        # This run's timelines (recovery/lineage.py): rank 0's clock, shared with the address
        self._began = address.started if address is not None and address.started else time.time_ns()
        self._lineage = (self._began, 0, -1)
        self._run = address.run if address is not None else process_run()  # rank 0's process: every rank's
        self._loads = 0  # load() calls so far: the n-th of every rank meet (recovery/meet.py)
        self._loaded = False  # a load() returned: saves go on from the timeline it chose
        self._restored = -1  # the step the last load() restored (saves must be newer)
        self._last_step = -1  # the step of the last save() call for a new step (writer/sequence.py)
        params = WriterParams(
            rank=self.rank,
            gen=next_generation(),
            store=address,
            outcome_timeout_s=self.config.slot_timeout_s,
            world_size=self.world_size,
            targets=targets,
            sources=sources,
            local_dir=self.config.local_dir,
            job=self.config.job,
            node=self.config.node,
            keep=self.config.keep,
            share_replicas=self.config.share_replicas,
            persist=wiring.persist_params(self.config, self.rank, self.world_size, self._run),
            node_folders=node_folders,
            log_level=log.getEffectiveLevel(),
        )
        self.replica_targets = targets
        self._stager.replica_slots = len(sources) * self.config.keep  # partners' shards held here
        self._writer_params = params
        self._writer_lock = threading.Lock()
        self._writer_restarts = 0
        self._saves = 0
        # The highest step save() took or published as failed (a failure is published only
        # above it); steps this rank's RAM folder already holds count.
        self._highest = self.ring.newest_step()
        self._held_at_start = self._highest  # an earlier run's newest step on this node (-1: none)
        self._stage_pool = ThreadPoolExecutor(1, thread_name_prefix="incluster-stage")
        self._handover = HandOver(self._stage_pool.submit, lambda: getattr(self._writer, "started", None))
        self._stager.hand_over_waiting = lambda: self._handover.waiting > 0
        self._inflight: StageJob | None = None
        self._healing: Future[None] | None = None  # a peer restore's heal, on the staging thread
        self._pending: list[SaveHandle] = []
        self._errors: list[tuple[SaveHandle, BaseException]] = []
        self._lock = threading.Lock()
        # save() and close() one at a time: a close() on another thread never shuts the
        # staging pool under a save() that already passed its "closed?" check
        self._api = threading.RLock()
        self._api_threads: dict[int, str] = {}  # thread id -> the API call it is inside (_api_call)
        self._pid = os.getpid()  # a forked child's save() is refused
        self._created = time.time()  # slot files older than this are an earlier run's (recovery/node.py)
        self._closed = False
        self._checked_out = False  # out of the job store already (an exit with nothing in flight)
        self._writer: Writer = (
            # started, not awaited: its start (a torch import) overlaps load()'s restore; on the
            # thread that lives as long as the process (a writer dies with the thread that
            # started it: a Checkpointer made on a thread that then ends lost it)
            writer_spawner().submit(ProcessWriter, params, on_persisted=self._persisted, on_death=self._writer_died,
                              wait=False).result()
            if self.config.writer == "process"
            else ThreadWriter(params, on_persisted=self._persisted)
        )
        if self.config.writer == "process" and self.config.gpu_drain == "writer":
            from incluster.staging.remote_drain import RemoteDrain

            self._stager.remote = RemoteDrain(lambda: self._writer, self._mapped_slot_files)
            self._stager.remote_timeout_s = self.config.slot_timeout_s
            self._writer.drain_listener = self._stager.remote  # type: ignore[union-attr]
        self._guard = StepGuard(self._pre_step_hook)  # every optimizer step in the process
        self._clones = ClonePool()  # save()'s copies of unguarded CPU tensors, reused
        self._unguarded_warned = False
        self._warned_warm = False
        self._said_superseded = False
        self._given_up = False
        self._shrunk_to: int | None = None
        self.last_restore: RestoreReport | None = None
        self._old_world: int | None = None  # after a resharding restore: the world it came from
        launch.close_at_exit(self)
        self.events: ev.EventRecorder | ev.NullRecorder = (
            ev.EventRecorder(self.config.run_dir, self.rank) if self.config.run_dir else ev.NULL_RECORDER
        )
        self.events.record(ev.START, world_size=self.world_size, node=self.config.node)

    def _abandon(self, exc: BaseException) -> None:
        """``__init__`` failed after the claim: stop what it started, release the claim;
        with the job store up, tell the replication partners that this rank's writer will
        not come (theirs stop waiting for it at once, and say why)."""
        self._closed = True  # first: a death of the writer being stopped starts no successor
        for part, stop in (("_guard", lambda g: g.close()), ("_writer", lambda w: w.close(1.0)),
                           ("_stage_pool", lambda p: p.shutdown(wait=False)), ("ring", lambda r: r.close()),
                           ("events", lambda e: e.close())):
            if hasattr(self, part):
                try:
                    stop(getattr(self, part))
                except Exception:  # noqa: BLE001 - the original error is the one to see
                    pass
        # After the writer is stopped (a writer still starting would say "0" over it), and
        # before the job store goes (rank 0 hosts it).
        address = getattr(self, "_store_address", None)
        if address is not None and self.world_size > 1:
            try:
                announce_writer(address, self.config.job, self.rank, "gone",
                                why=f"rank {self.rank}'s Checkpointer() failed: {exc}"[:2000])
            except Exception:  # noqa: BLE001 - they time out instead
                pass
        self._store_server = None  # the job store (rank 0) goes with its last reference
        self._claim.release()

    @property
    def gpu_snapshot_active(self) -> bool:
        """Whether the last GPU save went through the device-side snapshot."""
        return self._stager.device_active

    @property
    def gpu_drain_in_writer(self) -> bool:
        """Whether the writer process has the device-side snapshot open (its drains run there)."""
        remote = self._stager.remote
        return bool(remote is not None and remote.is_open(self._writer))

    def _mapped_slot_files(self) -> list[tuple[int, str, int, int]]:
        """(index, path, size, mapping generation) of the slot files mapped here, free or
        mapped ahead: the writer page-locks them before a drain does."""
        return [(s.index, s.path, s.size, s.maps) for s in self.ring.mapped_slots()]

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid: None for the thread writer, and while a writer that
        died is being replaced (its successor's pid follows)."""
        return None if getattr(self._writer, "dead", None) else self._writer.pid

    # -- saving -----------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, persist: bool | None = None) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns once the state may be used again
        by forward/backward. Tensors may not be mutated until ``handle.staged`` (the
        optimizer pre-step hook waits for it automatically). ``persist``: True uploads
        this step to the persistent tier whatever its schedule (after an upload still
        running, never skipped for it: the run's last step, say), False never; None
        follows ``persistent_every``/``persistent_interval_s``. Every rank passes the same."""
        t0 = time.perf_counter()
        if os.getpid() != self._pid:  # before any lock: one held by a parent's thread at the fork never frees
            raise CheckpointError(f"this Checkpointer was made in process {self._pid}; a forked child (process "
                                  f"{os.getpid()}) cannot save through it: save from the parent, or make a new "
                                  f"Checkpointer (another job name) in the child")
        with self._api_call("save()"):
            return self._save(step, state, t0, persist)

    def _save(self, step: int, state: Mapping[str, Any], t0: float, persist: bool | None = None) -> SaveHandle:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")
        step = _config.step_number(step)
        if persist is not None and not isinstance(persist, bool):
            raise ValueError(f"persist must be True, False or None (got {persist!r})")
        if persist and self.config.persistent is None:
            raise ValueError(f"save({step}, persist=True) needs a persistent tier: pass persistent=<path or URL> "
                             f"to the Checkpointer (or set INCLUSTER_PERSISTENT)")
        ordinal, self._saves = self._saves, self._saves + 1  # counted even if it fails: alike on every rank
        prev = self._last_step
        lent: list[torch.Tensor] = []  # pooled clones this save holds until it is staged
        try:
            try:
                self._check_usable(peers=False)  # an earlier background error of this rank surfaces here
            except CheckpointError as exc:
                if not self._closed:
                    add_note(exc, f"save({step}) raised this error of an earlier save instead of starting: step "
                               f"{step} is not saved (on any rank); the next save() goes on as usual")
                raise
            gone = self._writer_gone()
            if gone is not None:  # every save would fail in the background: say so here, each time
                raise gone
            if not os.path.isdir(self.ring.folder):  # every commit would fail on a vanished staging file
                raise TierUnavailableError(
                    f"save({step}): this rank's RAM folder {self.ring.folder} was removed while the job ran (the "
                    f"steps it held are gone; systemd-logind's RemoveIPC=yes removes a user's /dev/shm files when "
                    f"they log out, and so may a cleanup job): no save can land in it again. Restart the job (it "
                    f"restores from other nodes' replicas or the persistent tier), and keep the folder from being "
                    f"removed (RemoveIPC=no in /etc/systemd/logind.conf, or another local_dir)")
            if step <= self._restored:  # a slot need not hold the restored step (resharded, or not healed)
                raise CheckpointError(
                    f"step {step} is not newer than step {self._restored}, which load() restored; checkpoint "
                    f"steps must increase (continue from the step load() returned)")
            if not self._loaded and step <= self._held_at_start:
                raise CheckpointError(
                    f"job {self.config.job!r} already holds step {self._held_at_start} on this node from an earlier "
                    f"run, and this run did not call load(): checkpoint steps must increase. Call "
                    f"ckpt.load(state) first to continue the job, or name a new job (job=...) to start afresh")
            snap, _, left = snapshot(state, allow_pickle=self.config.allow_pickle, guarded=self._guard.pointers,
                                     clone=functools.partial(self._clones.clone, lent=lent))
            if left and not self._unguarded_warned:
                self._warn_unguarded(left)
            try:
                slot = self._take_slot(step)  # never a wait for the writer's start (early_saves)
            except OSError as exc:  # the RAM folder: not writable, gone, full
                raise TierUnavailableError(
                    f"save({step}) cannot use this node's RAM folder {self.ring.folder}: {type(exc).__name__}: "
                    f"{exc}; fix its permissions or free room there, or pass another local_dir (the committed "
                    f"steps are intact)") from exc
        except BaseException as exc:
            self._clones.give_back(lent)
            self._refused(step, exc, (prev, ordinal, self._loads))
            raise
        self._highest = max(self._highest, step)
        self._last_step = step
        job = StageJob(step=step, snap=snap, slot=slot, ordinal=ordinal, prev=prev, timeline=self._loads,
                       lineage=self._lineage, persist=persist)
        if lent:  # staged (or failed): every byte of them is in the slot, or never will be
            job.staged.add_done_callback(lambda _: self._clones.give_back(lent))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            from incluster.staging import cuda

            job.cuda_start = cuda.record_start(self._stager.cuda_devices)
        # Replication and the commit outcome each wait up to slot_timeout_s; past both (and
        # staging), a writer or peer has stopped answering: wait() says so instead of hanging.
        handle = SaveHandle(step=step, staged=job.staged, started=t0, deadline_s=3 * self.config.slot_timeout_s)
        if self._old_world is not None:
            handle.durable.add_done_callback(self._drop_old_world)
        with self._lock:
            self._inflight = job
            self._pending.append(handle)
        try:
            self._stage_pool.submit(self._stage, job, handle)
        except RuntimeError as exc:  # its pool is shut down: the interpreter is exiting
            self._not_staged(job, handle, exc)
        handle.blocked_s = time.perf_counter() - t0
        self.events.record(ev.SAVE, step=step, blocked_s=handle.blocked_s)
        return handle

    def _not_staged(self, job: StageJob, handle: SaveHandle, exc: BaseException) -> None:
        """save() found the staging thread gone (Python shuts thread pools down before the
        ``atexit`` hooks run): nothing is left pending for wait() and close(); raised."""
        err = CheckpointError(
            f"save({job.step}) cannot be staged: {exc}. Python shuts its thread pools down before the exit "
            f"hooks (atexit) run: save before the interpreter exits (at the end of training, or in a signal "
            f"handler)")
        with self._lock:
            self._pending.remove(handle)
            self._inflight = None
        self.ring.release(job.slot)
        handle.reported = True  # raised here, not again by wait() or close()
        self._tell_failed(job, handle, err)
        raise err from exc

    def _refused(self, step: int, exc: BaseException, seq: tuple[int, int, int]) -> None:
        """save(step) raised on this rank: publish the step as failed, so no partner waits
        ``slot_timeout_s`` for a shard that will never come. Not for a step that is not new
        here (a repeated or decreasing step must not un-commit the step already saved under
        that number). Sent behind the staging of the saves before it, so the writer hears
        of the steps in the order save() was called (writer/sequence.py)."""
        if step <= self._highest:
            return
        self._highest = self._last_step = step
        reason = f"save() raised on rank {self.rank}: {type(exc).__name__}: {exc}"

        def publish() -> None:
            try:
                self._tell_writer_failed(step, reason, seq)
            except Exception as err:  # noqa: BLE001 - the caller gets the original error
                log.warning("incluster: rank %d could not tell the other ranks that step %d failed: %s",
                            self.rank, step, err)

        try:
            self._stage_pool.submit(self._handover.run, publish)  # behind the saves before it
        except RuntimeError:  # shut down: nothing is staging
            publish()

    def _warn_unguarded(self, left: list[torch.Tensor]) -> None:
        self._unguarded_warned = True
        log.warning(
            "incluster: %d tensor(s) of %.1f MiB in the saved state are neither parameters nor state "
            "of an optimizer seen stepping, and too large to copy at save() time; they are copied "
            "in the background: change them only after handle.staged (ckpt.wait_staged()). "
            "Tensors that never change (frozen weights) need nothing. Said once.",
            len(left), sum(t.nbytes for t in left) / 2**20,
        )

    def prepare(self, state: Mapping[str, Any]) -> "Future[None]":
        """Get every slot file ready for a state shaped like ``state`` - allocated, mapped,
        page-locked when it is on a GPU - and the device-side snapshot buffer, in the
        background; the first save then only copies. Call it once the state has its full
        shape (after the first optimizer step creates the optimizer's state), overlapped
        with training. Returns a future that resolves when everything is ready, the writer
        process included (it starts with the Checkpointer, in the background; saves made
        before it answers may be given up for newer ones, see ``early_saves``). Also makes
        the reused memory save() copies unguarded CPU tensors into (see ``guard.ClonePool``)."""
        with self._api_call("prepare()"):
            return self._prepare_call(state)

    def _prepare_call(self, state: Mapping[str, Any]) -> "Future[None]":
        self._check_usable()
        shapes: list[tuple[torch.dtype, tuple[int, ...]]] = []

        def note(t: torch.Tensor) -> torch.Tensor:  # what save() would clone: made, not copied, here
            if t.device.type == "cpu":
                shapes.append((t.dtype, tuple(t.shape)))
            return t

        snap, found, _ = snapshot(state, allow_pickle=self.config.allow_pickle, guarded=self._guard.pointers,
                                  clone=note)
        if found and not any(o.state or self._guard.stepped(o) for o in found):
            log.warning("incluster: prepare() before the first optimizer step: the optimizer's state (Adam's "
                        "moments, momentum buffers) does not exist yet, so the slots made now are too small and "
                        "are made again at the first save; call prepare() after the first optimizer.step()")
        return _then_started(self._stage_pool.submit(self._prepare, snap, clone_shapes=shapes), lambda: self._writer)

    def record_step(self, step: int) -> None:
        """Mark training progress (cheap, buffered) so goodput reports can tell exactly
        how much work a failure cost. Optional."""
        self.events.record(ev.TRAIN_STEP, step=step)

    def _pre_step_hook(self, *_: Any) -> None:
        """Optimizer pre-step: parameters must not change before the save's copy (or a
        restore's heal) is done. Host time spent waiting is recorded as save cost."""
        self.events.alive()  # goodput: training ran until here (written by the recorder's thread)
        healing = self._healing
        if healing is not None and not healing.done():
            t0 = time.perf_counter()
            try:
                healing.result(self.config.slot_timeout_s)
            except TimeoutError:
                raise PeerTimeoutError(
                    f"writing the restored step into this node's RAM disk did not finish within "
                    f"{self.config.slot_timeout_s:.0f} s; the optimizer step cannot run before it"
                ) from None
            finally:
                self.events.record(ev.STAGE_WAIT, step=self.last_restore.step if self.last_restore else None,
                                   seconds=time.perf_counter() - t0)
        job = self._inflight
        if job is None or job.staged.done() or job.host_done.is_set():
            if job is not None and job.cuda_done and not job.staged.done():
                from incluster.staging import cuda

                cuda.wait_on_compute(job.cuda_done)
            return
        t0 = time.perf_counter()
        done = job.host_done.wait(self.config.slot_timeout_s)
        self.events.record(ev.STAGE_WAIT, step=job.step, seconds=time.perf_counter() - t0)
        if not done:
            raise PeerTimeoutError(
                f"staging of step {job.step} did not finish within {self.config.slot_timeout_s:.0f} s; "
                f"the optimizer step cannot run before it (raise slot_timeout_s?)"
            )
        if job.cuda_done:
            from incluster.staging import cuda

            cuda.wait_on_compute(job.cuda_done)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the latest save's bytes are copied out (and a peer restore's copy is
        written to this node); then tensors may change in any way."""
        t = timeout if timeout is not None else self.config.slot_timeout_s
        if self._healing is not None:
            self._healing.result(t)
        job = self._inflight
        if job is not None:
            job.staged.result(t)

    def __enter__(self) -> "Checkpointer":
        return self

    def _on_map(self, slot: Slot) -> None:
        """A slot was (re)mapped, on the staging thread: page-lock it if saves are on a GPU."""
        if self._stager.pin:
            from incluster.staging import cuda

            cuda.register(slot, self._stager.cuda_device)

    @staticmethod
    def _on_unmap(slot: Slot) -> None:
        if slot.pinned:
            from incluster.staging import cuda

            cuda.unregister(slot)


def _then_started(slots: "Future[None]", writer: Callable[[], Any]) -> "Future[None]":
    """Resolves once ``slots`` did (with their error, if any) and the current writer's start
    has ended. A start that failed is not raised here: a successor starts at once, and
    the saves report a writer that could not be had (``WriterProcessDied``)."""
    out: Future[None] = Future()

    def prepared(f: "Future[None]") -> None:
        err = f.exception()
        start = getattr(writer(), "started", None)  # a thread writer has none
        if err is not None:
            out.set_exception(err)
        elif start is None:
            out.set_result(None)
        else:
            start.add_done_callback(lambda _: out.set_result(None))

    slots.add_done_callback(prepared)
    return out
