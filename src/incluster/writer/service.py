"""What a writer does, wherever it runs: commit a staged slot, count it, await the outcome.

Used by the thread writer (inside the trainer process) and by the writer process.
Holds two coordinator clients: one for counting and publishing, one that blocks waiting
for outcomes, so a slow peer never stalls the next local commit.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import sys
import threading
from typing import Any, Callable

from incluster.commit import Coordinator, Outcome, SoloCoordinator, StoreCoordinator
from incluster.errors import CheckpointError
from incluster.testing import faults
from incluster.writer.local_commit import CommitRequest, commit_shard
from incluster.writer.protocol import WriterParams
from incluster.writer.sequence import SaveSequence, SkippedByOthers

log = logging.getLogger("incluster")


def _coordinator(params: WriterParams) -> Coordinator:
    if params.store is None:
        return SoloCoordinator()
    return StoreCoordinator(params.store, params.rank)


class _NoCount:
    """Re-replication after a restore is not a new commit: nothing to count."""

    def committed(self, step: int) -> None:
        pass

    def failed(self, step: int, reason: str) -> str:
        return "fail"

    def at(self, timeline: int) -> _NoCount:
        return self


_QUIET_S = 5.0  # close(): how long an upload in flight is waited for before saying so


class CommitService:
    def __init__(self, params: WriterParams) -> None:
        self.params = params
        self.coord = _coordinator(params)
        self.watch = self.coord if params.store is None else _coordinator(params)
        self._maps: dict[str, tuple[int, int, int, mmap.mmap, int]] = {}  # slot key -> (ino, size, fd, map, gen)
        self._maps_lock = threading.Lock()
        self._unchecked: str | None = None  # the kind of error the sequence check last failed with (said once)
        self.on_unmap: Callable[[mmap.mmap], None] | None = None  # before a mapping is closed
        self._outcomes: list[int] = []  # the first two durable steps this writer saw
        # load() calls before the newest save this writer heard of: a step's keys in the job
        # store are those of its timeline (Coordinator.at). Passed along with each step
        # where the caller knows it; this one for the rest (a step this rank skipped).
        self.timeline = 0
        # Called (commit thread) for a step the others saved and this rank skipped, before this
        # rank's next exchange: the writer takes part in its exchange with nothing to send.
        self.on_skipped: Callable[[int, int], None] | None = None  # (step, timeline)
        self.sequence = None if params.store is None else SaveSequence(
            params.rank, self.coord.successor, self._fail_skipped, self._skipped)
        self.uploader = None
        if params.persist is not None:
            from incluster.persist import Uploader

            # Blocking waits (time-based decisions, a persist=True save's outcome) on a client
            # of their own: a store client serves one call at a time, and an upload's count
            # must never queue behind one. Without time-based decisions it is made only when
            # a persist=True save first needs it.
            timed = params.persist.interval_s is not None
            self.uploader = Uploader(params.persist, _coordinator(params), _coordinator(params) if timed else None,
                                     spare=lambda: _coordinator(params))
        self.replicator = None
        if (params.targets or params.sources) and params.store is not None:
            from incluster.replication import Replicator

            self.replicator = Replicator(
                params.store,
                params.rank,
                params.world_size,
                params.targets,
                params.sources,
                local_dir=params.local_dir,
                job=params.job,
                node=params.node,
                keep=params.keep,
                share=params.share_replicas,
                timeout_s=params.outcome_timeout_s,
                incarnation=params.incarnation,
            )

    def commit(self, req: CommitRequest, buf: Any = None) -> tuple[str, Any, bool]:
        """Commit locally, then count the commit in the job store.

        Returns the shard path, what :meth:`replicate` and :meth:`upload` need, and whether
        this step goes to the persistent tier (its slot stays pinned until the upload ends)."""
        self.timeline = req.timeline
        try:
            ordinal = req.ordinal
            # first: a step that fails later still has its place in the sequence
            if self.sequence is not None and self.sequence.check(req.step, req.prev, req.ordinal, req.timeline):
                ordinal = self.sequence.ordinal
            faults.check("commit", req.rank, req.step)
            if buf is None:
                buf = self._map(req) if req.size else b""
            path, sidecar = commit_shard(req, buf)
        except BaseException as exc:
            self.fail(req.step, f"{type(exc).__name__}: {exc}", req.timeline)
            raise
        persist = self.uploader is not None and (self.uploader.due(req.step, ordinal) if req.persist is None
                                                 else req.persist)
        if persist and self.uploader is not None and self.uploader.p.interval_s is None:
            # Counted before the commit: once the step commits, the count says how many
            # ranks upload it (a persist=True save checks that every rank does)
            self.coord.at(req.timeline).forced(req.step)
        self.coord.at(req.timeline).committed(req.step)
        faults.check("counted", req.rank, req.step)
        import json

        from incluster.format.checksum import content_id
        from incluster.replication import OwnShard

        own = OwnShard(json.dumps(sidecar.to_json()).encode(), buf, req.size, content_id(sidecar.checksum))
        if persist:
            self.uploader.loaded = req.loaded  # type: ignore[union-attr]
        return path, own, persist

    def _fail_skipped(self, step: int, why: str) -> bool:
        assert self.sequence is not None
        return self.fail(step, why, self.sequence.timeline)

    def _skipped(self, step: int, timeline: int) -> None:
        if self.on_skipped is not None:
            self.on_skipped(step, timeline)

    def exchanged(self, step: int, seq: tuple[int, int, int] | None = None) -> bool:
        """Whether the partners exchange ``step``'s replicas with this rank, which failed it:
        not when the others did not save that step (writer/sequence.py). ``seq``: the
        trainer's previous step, its count of saves and of loads (CommitRequest's prev,
        ordinal, timeline), if known. Commit thread, in step order."""
        if self.sequence is None or (seq is None and self.sequence.pos is None):
            return True  # nothing to compare with: take part, as before
        prev, ordinal, timeline = seq if seq is not None else (-1, 0, self.sequence.timeline)
        try:
            self.sequence.check(step, prev, ordinal, timeline)  # the verdict its commit got, if it got that far
        except SkippedByOthers:
            return False
        except Exception as err:  # noqa: BLE001 - the store is gone: take part, as before
            kind = type(err).__name__  # a lost store fails every later check alike: said once, then at INFO
            (log.info if kind == self._unchecked else log.warning)(
                "incluster: rank %d could not check step %d against the other ranks' saves: %s",
                self.params.rank, step, err)
            self._unchecked = kind
            return True
        self._unchecked = None
        return True

    def _timeline(self, timeline: int | None) -> int:
        return self.timeline if timeline is None else timeline

    def upload(self, step: int, own: Any, done: Any, timeline: int | None = None, forced: bool = False) -> bool:
        """Start the persistent upload of a committed shard; False if skipped. ``forced``
        (save(persist=True)): whatever the schedule, behind an upload still running."""
        if self.uploader is None:
            return False
        return self.uploader.start(step, own.sidecar, own.buf, own.size, done, self._timeline(timeline), forced=forced)

    def replicate(self, step: int, own: Any, timeline: int | None = None) -> None:
        """Exchange ``step``'s replicas with this rank's partners (``own`` None: nothing to
        send, but still take part, so no partner waits). Failures fail the step."""
        if self.replicator is None:
            return
        timeline = self._timeline(timeline)
        try:
            faults.check("replicate", self.params.rank, step)
            self.replicator.exchange(step, own, self.coord.at(timeline))
        except BaseException as exc:
            # Only a step known to have failed loses the replicas held here: one already
            # durable (this exchange broke after counting it, e.g. as rank 0's process ended
            # and took the job store along) or whose outcome the lost store leaves unknown
            # keeps them - they may be the only copies of a rank's shard after a node loss.
            if self.fail(step, f"replication: {type(exc).__name__}: {exc}", timeline):
                self.on_failed(step)
            raise
        if own is None:  # this rank failed the step: it can never be complete anywhere
            self.on_failed(step)

    def replicate_committed(self, folder: str, step: int) -> None:
        """After a restore: send this rank's (healed) shard of ``step`` to its partners.
        Every rank's writer takes part (one whose node has no copy sends nothing); partners
        that hold it already decline the bytes."""
        if self.replicator is None:
            return
        import json

        from incluster.format.checksum import content_id
        from incluster.format.sidecar import read_sidecar
        from incluster.replication import OwnShard
        from incluster.staging.slots import sidecar_file
        from incluster.tiers.local import data_path

        if not os.path.exists(os.path.join(folder, sidecar_file(step))):
            # This node's copy could not be written (a full RAM disk): nothing to send, but
            # take part, so partners re-sending theirs do not wait for us.
            self.replicator.exchange(step, None, _NoCount())  # type: ignore[arg-type]
            return
        path = None
        try:
            sc = read_sidecar(os.path.join(folder, sidecar_file(step)))
            # a shared copy's bytes are a data-parallel peer's file on this node
            path = data_path(folder, sc)
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except (OSError, CheckpointError) as exc:  # gone meanwhile: take part, send nothing
            shared = path is not None and os.path.dirname(os.path.abspath(path)) != os.path.abspath(folder)
            # A shared copy whose owner's bytes are not on this node yet (its replica is being
            # re-sent at this moment, after the same restore): nothing is wrong, nothing to send.
            (log.info if shared else log.warning)(
                "incluster: rank %d cannot re-send step %d (%s)%s; its partners keep what they hold",
                self.params.rank, step, exc, " - a shared copy whose owner's file has not reached this node yet"
                if shared else "")
            self.replicator.exchange(step, None, _NoCount())  # type: ignore[arg-type]
            return
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        try:
            own = OwnShard(json.dumps(sc.to_json()).encode(), mm if mm is not None else b"", size,
                           content_id(sc.checksum))
            self.replicator.exchange(step, own, _NoCount())  # type: ignore[arg-type]  # counts nothing
            self.replicator.set_global(step)
        finally:
            if mm is not None:
                mm.close()

    def upload_committed(self, folder: str, step: int, timeline: int, done: Any) -> None:
        """Upload this rank's committed shard of ``step`` now (close() catching the tier
        up: the newest due upload was skipped), in its own job-store keys
        (``protocol.AGAIN + timeline``). ``done(err)`` as for any upload."""
        import json

        from incluster.format.checksum import content_id
        from incluster.format.sidecar import open_regular, read_sidecar
        from incluster.replication import OwnShard
        from incluster.staging.slots import sidecar_file
        from incluster.tiers.local import data_path
        from incluster.writer.protocol import AGAIN

        if self.uploader is None:
            done("skipped: no persistent tier")
            return
        try:
            sc = read_sidecar(os.path.join(folder, sidecar_file(step)))
            fd = open_regular(data_path(folder, sc), "shard")
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
            finally:
                os.close(fd)
        except (OSError, CheckpointError) as exc:
            done(f"the committed copy of step {step} cannot be read here: {exc}")
            return
        own = OwnShard(json.dumps(sc.to_json()).encode(), mm if mm is not None else b"", size, content_id(sc.checksum))

        def ended(err: str | None) -> None:
            try:
                done(err)
            finally:
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:
                        pass  # a view of it is still alive: it closes with it
        if not self.uploader.start(step, own.sidecar, own.buf, own.size, ended, AGAIN + timeline, forced=True):
            ended("skipped: the writer is shutting down")

    def on_outcome(self, step: int) -> None:
        if self.replicator is not None:
            self.replicator.set_global(step)
        if len(self._outcomes) >= 2:
            return
        self._outcomes.append(step)
        if self.params.node_folders is not None and len(self._outcomes) == 2:  # once: see writer/sweep.py
            from incluster.writer.sweep import sweep_orphans

            try:
                sweep_orphans(self.params.local_dir, self.params.job, self.params.node_folders, self._outcomes[0])
            except OSError as exc:  # never a save's failure
                log.warning("incluster: could not remove old copies of other ranks from this node: %s", exc)

    def on_failed(self, step: int) -> None:
        """``step`` failed on some rank: the replicas of it held here are garbage; their
        slots are free again (else a replica ring full of a failed step refuses the next)."""
        if self.replicator is not None:
            self.replicator.discard(step)

    def fail(self, step: int, reason: str, timeline: int | None = None) -> bool:
        """Publish ``step``'s failure (first verdict wins); whether it is now known failed
        (False: it was durable already, or the store is gone and nobody can tell)."""
        timeline = self._timeline(timeline)
        try:
            known = str(self.coord.at(timeline).failed(step, reason)).startswith(Outcome.FAILED.value)
        except Exception:  # noqa: BLE001 - the store may be gone; peers then time out instead
            return False
        if known and self.uploader is not None:  # a durable step's upload goes on
            try:
                self.uploader.failed_step(step, timeline)
            except Exception:  # noqa: BLE001 - the other ranks' uploads of it time out instead
                pass
        return known

    def wait_outcome(self, step: int, timeline: int | None = None) -> None:
        faults.check("outcome", self.params.rank, step)
        self.watch.at(self._timeline(timeline)).wait_outcome(step, self.params.outcome_timeout_s)

    def _map(self, req: CommitRequest) -> mmap.mmap:
        # Hashed already (a GPU save): nothing reads it all now, so no page-table pass either.
        return self.map_slot(str(req.slot), req.staging_path, req.size, populate=req.digests is None, gen=req.maps)

    def map_slot(self, key: str, path: str, size: int, *, populate: bool, gen: int = 0) -> mmap.mmap:
        """The writer's own mapping of a slot file, kept while the slot's inode, size and
        mapping generation in the trainer (``gen``, ``Slot.maps``) stay. A slot the trainer
        cut and grew back to its old size is the same inode and size, but the pages beyond
        the cut are new ones: a mapping page-locked before (``device_drain``) would still
        pin the old ones, and a copy into it would land where the file no longer looks.
        Called by the drains (the writer's main loop) and the commits (their own thread)."""
        with self._maps_lock:
            st = os.stat(path)
            cached = self._maps.get(key)
            if cached and cached[0] == st.st_ino and cached[1] == size and cached[4] == gen:
                return cached[3]
            if cached:
                self._unmap(cached)
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0))
            self._maps[key] = (st.st_ino, size, fd, mm, gen)
            return mm

    def _unmap(self, cached: tuple[int, int, int, mmap.mmap, int]) -> None:
        if self.on_unmap is not None:
            self.on_unmap(cached[3])
        try:
            cached[3].close()
        except BufferError:  # a view of it outlives its user (a storage client's failed request)
            gc.collect()
            try:
                cached[3].close()
            except BufferError:
                pass  # unmapped when the last view goes, or when the process ends
        os.close(cached[2])

    def close(self, timeout: float = 600.0) -> None:
        if self.sequence is not None:
            try:
                self.sequence.close()
            except Exception as exc:  # noqa: BLE001 - the store may be gone: nothing to tell
                log.info("incluster: rank %d: could not mark its last save in the job store: %s",
                         self.params.rank, exc)
        quiet = min(_QUIET_S, timeout / 2)
        idle = self.uploader is None or self.uploader.wait_idle(quiet)
        if not idle and timeout - quiet >= 1:  # a hung object store would hold close() for minutes without a word
            print(f"incluster writer: rank {self.params.rank}: close() waits up to {timeout - quiet:.0f} s more for "
                  f"the persistent upload in flight", file=sys.stderr)
            idle = self.uploader.wait_idle(timeout - quiet)  # type: ignore[union-attr]
        why = self.uploader.cancel() if self.uploader is not None else None  # nothing starts after this
        if not idle:
            # The upload still reads its slot's mapping: leave every mapping to the exit.
            if why is not None:
                print(f"incluster writer: rank {self.params.rank}: the persistent upload did not finish within "
                      f"{timeout:.0f} s of shut-down: {why}", file=sys.stderr)
        else:
            with self._maps_lock:
                for cached in self._maps.values():
                    self._unmap(cached)
                self._maps.clear()
        if self.replicator is not None:
            self.replicator.close()
        self.coord.close()
        self.watch.close()
