"""The load half of :class:`~incluster.checkpointer.Checkpointer`: restore the newest
step every rank can verify (``recovery/restore.py``), then - in the background, behind the
optimizer pre-step hook - heal this node's copy, re-send replicas and get the slots ready.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Mapping

from incluster import wiring
from incluster import config as _config
from incluster.config import Config
from incluster.errors import CheckpointError, NoCheckpointError, TierUnavailableError
from incluster.goodput import events as ev
from incluster.recovery.heal import changing_pointers
from incluster.recovery.meet import ArrivalWatch
from incluster.recovery.restore import Context as RestoreContext
from incluster.recovery.from_persistent import abandon_in_tier
from incluster.recovery.restore import RestoreReport, restore
from incluster.staging.slots import SlotRing, sidecar_file
from incluster.state import snapshot
from incluster.testing import faults
from incluster.tiers.local import committed_steps

log = logging.getLogger("incluster")


class LoadPipeline:
    """Mixin of :class:`~incluster.checkpointer.Checkpointer`: ``load()`` and what it
    leaves running in the background."""

    config: Config
    rank: int
    world_size: int
    folder: str
    ring: SlotRing
    events: Any
    replica_targets: Any
    last_restore: RestoreReport | None
    _lock: threading.Lock
    _stage_pool: Any
    _healing: "Future[None] | None"
    _old_world: int | None
    _highest: int
    _restored: int
    _job_derived: bool
    _closed: bool
    _errors: list[Any]
    _store_address: Any
    _loads: int
    _refuse_resize: str | None
    _left_out_ok: bool
    _began: int
    _lineage: tuple[int, int, int]
    _run: str  # the run id (rank 0's process's)
    _created: float  # when this Checkpointer was made (time.time())
    _last_step: int
    _saves: int
    # the Checkpointer's own (and SavePipeline's) methods this half calls
    _wait: Callable[..., None]
    _api_call: Callable[..., Any]
    _check_usable: Callable[..., None]
    _live_writer: Callable[[], Any]
    _writer: Any
    _prepare: Callable[..., None]

    def load(self, state: Mapping[str, Any], *, step: int | None = None) -> int | None:
        """Restore the newest step that every rank can get a verified copy of - from its
        own node, a peer's RAM, or else the persistent tier - into ``state`` in place.
        Returns the step, or None when nothing was saved. Collective: every rank calls it.
        The decision is kept in ``last_restore`` and logged in one line per rank.

        ``step``: that step and no other (a rollback, say), from wherever it is; every rank
        passes the same (rank 0's is used). NoCheckpointError when it cannot be restored,
        before any byte lands. The steps saved after it are then dropped from this node's
        RAM (set aside in the persistent tier), and the saves from here on are a new
        timeline: no later restore takes the dropped steps, a restart before the next save
        included."""
        with self._api_call("load()"):
            return self._load_marked(state, step)

    def _load_marked(self, state: Mapping[str, Any], step: int | None) -> int | None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")
        if step is not None:
            step = _config.step_number(step)
        if not isinstance(state, Mapping):  # as save() says it (before the count: the call never began)
            raise CheckpointError(
                f"state must be a dict of named parts, e.g. {{'model': model, 'optim': optim}}, "
                f"not a {type(state).__name__}")
        self._loads += 1  # first: every rank's n-th call is the same call, whatever fails below
        # the saves after it are a new sequence (writer/sequence.py), numbered from 0 again
        self._last_step, self._saves = -1, 0
        t0, before = time.perf_counter(), self.last_restore
        try:
            with ArrivalWatch(self._store_address, self.rank, "load()", self._loads):
                step = self._load(state, step)
            self._loaded = True
            # Not waiting for the writer process's start (a fresh interpreter importing
            # torch: seconds with several ranks per node, often longer than the restore):
            # training goes on at once, and a save made before the writer is up queues
            # behind its start. A start that fails is a writer death like any other
            # (started again in the background; the saves it held fail with the reason).
        finally:
            # The whole call is what training waited for (the goodput report counts it as
            # load time, not as training). Also when what came after the restore raised:
            # the restore happened.
            report = self.last_restore
            if report is not None and report is not before:
                self.events.record(ev.LOAD, step=report.step, source=report.source, bytes=report.bytes,
                                   seconds=time.perf_counter() - t0, restore_s=report.seconds)
        return step

    def _load(self, state: Mapping[str, Any], only: int | None = None) -> int | None:
        try:
            self._wait()  # saves in flight end first; their failures are superseded by the restore
        except CheckpointError as exc:
            # Raised here on some ranks only, it would leave the others waiting in the
            # restore's collectives: reported, not raised.
            log.warning("incluster: rank %d: an earlier save failed (%s); load() goes on", self.rank, exc)
        with self._lock:
            self._errors = []
        ctx = RestoreContext(
            local_dir=self.config.local_dir,
            job=self.config.job,
            rank=self.rank,
            world_size=self.world_size,
            node=self.config.node,
            ring=self.ring,
            allow_pickle=self.config.allow_pickle,
            timeout_s=self.config.slot_timeout_s,
            persistent=wiring.persistent_tier(self.config),
            rank_state=self.config.reshard_rank_state,
            refuse_resize=self._refuse_resize,
            left_out_ok=self._left_out_ok,
            only_step=only,
            since=self._created,
        )
        # The saves from here on are a new timeline, going on from the restored step (from
        # nothing, should the restore fail and the caller save anyway)
        before, self._lineage = self._lineage, (self._began, self._loads, -1)
        try:
            report = restore(ctx, state)
        except (NoCheckpointError, TierUnavailableError):
            # Refused before any byte landed: the live state still goes on from where it
            # was (a save now must not start a timeline that abandons every earlier step).
            self._lineage = before
            raise
        self.last_restore = report
        self._lineage = (self._began, self._loads, -1 if report.step is None else report.step)
        heal = ctx.heal
        log.info("%s", report.line())
        if report.step is None and self.rank == 0 and self._job_derived:
            others = _other_jobs(self.config.local_dir, self.config.job)
            held = "" if not others else f". {self.config.local_dir} holds " + ", ".join(
                f"job {j!r} (newest step {n})" for j, n in others)
            log.warning("incluster: nothing to restore for job %r, a name derived from this launch (the "
                        "script and folder, or torchrun's run id or rendezvous endpoint); if this run should "
                        "resume an earlier one launched otherwise, pass job= or set INCLUSTER_JOB%s",
                        self.config.job, held)
        if report.step is not None and (report.first_chosen or -1) > report.step and self.rank == 0:
            log.warning("incluster: restored step %d, not the newer step %d, which could not be restored (see the "
                        "messages above); training goes on from step %d", report.step, report.first_chosen, report.step)
        if report.source == "reshard":
            self._old_world = report.old_world
        if report.step is not None and only is not None and self.rank == 0:
            abandon_in_tier(ctx.persistent, self.config.job, report.step, self._run, self._began)
        if report.step is None:
            self._highest = self.ring.newest_step()  # started afresh: the never-complete copies are gone
        if report.step is not None:
            self.ring.reset_to(report.step)
            self._highest = self._restored = report.step
            # A resharded step has no copy in this world's layout to replicate: the next save makes one.
            replicate = bool(self.replica_targets or self.world_size > 1) and report.source != "reshard"
            if heal is not None:
                # The received copy is verified and in place; writing it into this node's
                # RAM disk overlaps the next forward/backward, behind the pre-step hook.
                heal.keep_apart(changing_pointers(state, heal.sidecar.tree, allow_pickle=self.config.allow_pickle))
                self._healing = self._stage_pool.submit(self._heal, heal, report.step, replicate)
            elif replicate:
                self._replicate_restored(report.step)  # heal the replicas, in background
            self._prepare_after_load(state)  # after the heal, which the next optimizer step waits for
        # Nothing restored: the state is not read at all. Its state_dict() may have side
        # effects (torch's get_optimizer_state_dict steps a fresh optimizer once to create
        # its state), and a fresh optimizer's layout is not the one its first save will have.
        return report.step

    def _drop_old_world(self, durable: "Future[None]") -> None:
        """After a resharding restore, once a step of this world is durable everywhere: the
        folders of old ranks this world does not have hold only the old world's copies, which
        no ring recycles. They go (each node's RAM gets them back)."""
        if durable.cancelled() or durable.exception() is not None or self._old_world is None:
            return
        old, self._old_world = self._old_world, None
        if old <= self.world_size:  # the world grew: every old rank is in this one
            return
        base = os.path.join(self.config.local_dir, self.config.job)
        for owner in range(self.world_size, old):
            shutil.rmtree(os.path.join(base, f"rank-{owner:05d}"), ignore_errors=True)
        log.info("incluster: rank %d: the old world's copies of ranks %d..%d are dropped from this node", self.rank,
                 self.world_size, old - 1)

    def _heal(self, heal: Any, step: int, replicate: bool) -> None:
        """Staging thread, after a peer restore: commit this node's copy, then re-send replicas."""
        t0 = time.perf_counter()
        try:
            faults.check("heal", self.rank, step)
            heal.heal()
        except BaseException as exc:  # noqa: BLE001 - the restore itself succeeded; peers still hold copies
            heal.abandon()
            log.warning("incluster: rank %d could not write its node's copy of step %d (%s); its replicas "
                        "elsewhere still hold it, and the next save is written as usual", self.rank, step, exc)
            if replicate:
                self._replicate_restored(step)  # sends nothing, but partners re-sending wait for every rank
            return
        log.info("incluster: rank %d healed its node's copy of step %d in %.3f s", self.rank, step, time.perf_counter() - t0)
        if replicate:
            self._replicate_restored(step)

    def _replicate_restored(self, step: int) -> None:
        try:
            self._live_writer().replicate(self.folder, step)
        except CheckpointError as exc:  # the next save replicates anyway, and reports the writer
            log.warning("incluster: rank %d could not re-send the replicas of step %d: %s", self.rank, step, exc)

    def _prepare_after_load(self, state: Mapping[str, Any]) -> None:
        """The slot files for a state of this shape are made in the background now, so
        the first save does not allocate them (a state that grows at its first optimizer
        step is re-made after the save that shows it). Never fails the load."""
        try:
            snap, _, _ = snapshot(state, allow_pickle=self.config.allow_pickle)
            self._stage_pool.submit(self._prepare, snap, False)
        except Exception as exc:  # noqa: BLE001 - an optimisation only; save() reports real problems
            log.debug("incluster: slots not prepared after load: %s", exc)


def _other_jobs(local_dir: str, job: str) -> list[tuple[str, int]]:
    """Other jobs with steps in this node's ``local_dir`` (their newest step), the most
    recently saved first: a relaunch whose derived name changed (another rendezvous port,
    say) finds them named. At most 3."""
    found: list[tuple[float, str, int]] = []
    try:
        with os.scandir(local_dir) as entries:
            jobs = [e for e in entries if e.name != job and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    for entry in jobs:
        newest, when = -1, 0.0
        try:
            with os.scandir(entry.path) as ranks:
                folders = [r.path for r in ranks if r.name.startswith("rank-") and r.is_dir(follow_symlinks=False)]
            for folder in folders:
                steps = committed_steps(folder)  # newest first
                if steps and steps[0] > newest:
                    newest = steps[0]
                    when = os.stat(os.path.join(folder, sidecar_file(newest)), follow_symlinks=False).st_mtime
        except OSError:
            continue
        if newest >= 0:
            found.append((when, entry.name, newest))
    return [(name, step) for _, name, step in sorted(found, reverse=True)[:3]]
