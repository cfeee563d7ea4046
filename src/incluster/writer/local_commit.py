"""The local commit of one staged shard: checksum, rename, sidecar (in that order).

A crash at any point leaves either the previous state (no sidecar for this step) or the
committed step; never a sidecar that vouches for bytes that were not all written.
Pure file operations on a mapped buffer: usable from a thread or a writer process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from incluster import reserve
from incluster.errors import CorruptCheckpointError
from incluster.format.checksum import DEFAULT_CHUNK, Checksum, compute, verify
from incluster.format.sidecar import Sidecar, write_sidecar
from incluster.staging.slots import sidecar_file, step_file
from incluster.testing import faults


@dataclass(frozen=True, kw_only=True)
class CommitRequest:
    """Everything the writer needs to commit a staged slot; picklable, no live objects."""

    folder: str
    slot: int
    staging_path: str
    size: int
    job: str
    step: int
    rank: int
    world_size: int
    node: str
    fingerprint: str
    tree: Any
    fsync: bool = False
    chunk: int = DEFAULT_CHUNK
    ordinal: int = 0  # this rank's count of save() calls since its last load() (writer/sequence.py numbers them)
    prev: int = -1  # the step of this rank's previous save() call (-1: the first): writer/sequence.py
    timeline: int = 0  # load() calls before this save: writer/sequence.py
    digests: tuple[str, ...] | None = None  # chunk digests the trainer computed as the bytes landed
    # gpu_drain="writer": (buffer id, file offset of the buffer, file ranges) to copy from the
    # trainer's device-side snapshot into the slot before the commit (the writer hashes them)
    drain: tuple[int, int, tuple[tuple[int, int], ...]] | None = None
    # load() ran in this Checkpointer before the save: the run chose where its timeline
    # goes on (tier_steps.TierSteps.open refuses an upload over newer steps without it)
    loaded: bool = False
    lineage: tuple[int, int, int] = (0, 0, -1)  # the timeline saving it (incluster.recovery.lineage)
    persist: bool | None = None  # save(persist=): True uploads it whatever the schedule, False never; None: the schedule
    # the slot's mapping generation in the trainer (Slot.maps): a slot resized since the
    # writer mapped it is mapped (and page-locked) again, even at its old size and inode
    maps: int = 0


    @property
    def place(self) -> tuple[int, int, int]:
        """(prev, ordinal, timeline): where this save stands in the sequence (writer/sequence.py)."""
        return self.prev, self.ordinal, self.timeline


def commit_shard(req: CommitRequest, buf: Any) -> tuple[str, Sidecar]:
    """Checksum ``buf`` (the slot mapping), rename the slot, write the sidecar last.

    Returns the committed shard path and its sidecar.
    """
    if req.digests is not None and len(req.digests) == max(1, -(-req.size // req.chunk)):
        checksum = Checksum(size=req.size, chunk=req.chunk, digests=tuple(req.digests))
    else:
        checksum = compute(buf, req.size, req.chunk)
    if req.fsync:
        # fsync of the file writes the mapping's dirty pages back (they are the file's page
        # cache) without holding the GIL, as mmap.flush() does for the whole msync: a long
        # flush silenced the writer's heartbeat, and the trainer took it for hung.
        fd = os.open(req.staging_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    final = os.path.join(req.folder, step_file(req.step))
    os.replace(req.staging_path, final)
    faults.check("sidecar", req.rank, req.step)
    sidecar = Sidecar(
        job=req.job,
        step=req.step,
        rank=req.rank,
        world_size=req.world_size,
        node=req.node,
        shard=step_file(req.step),
        checksum=checksum,
        fingerprint=req.fingerprint,
        tree=req.tree,
        created=time.time(),
        lineage=req.lineage,
    )
    path = os.path.join(req.folder, sidecar_file(req.step))
    job_folder = os.path.dirname(req.folder)
    reserve.write_or_spend(lambda: write_sidecar(path, sidecar, fsync=req.fsync), job_folder, req.rank)
    reserve.ensure(reserve.reserve_path(job_folder, req.rank), 2 * os.path.getsize(path))  # put back, if room
    return final, sidecar


def parse_received_sidecar(raw: bytes, where: str, *, rank: int, step: int, job: str, size: int) -> Sidecar:
    """A sidecar that came from a peer or a tier: valid, and for exactly what we expect."""
    try:
        sc = Sidecar.from_json(json.loads(raw), where)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: sidecar is not valid JSON ({exc})") from None
    if sc.rank != rank or sc.step != step or sc.job != job or sc.checksum.size != size:
        raise CorruptCheckpointError(
            f"{where}: the sidecar describes rank {sc.rank} step {sc.step} of job {sc.job!r} "
            f"({sc.checksum.size} bytes)"
        )
    return sc


_WHERE_KEPT = ("shared_with", "replica_on")


def commit_received(
    ring: Any, slot: Any, sc: Sidecar, where: str, *, node: str | None = None, verified: bool = False, **extra: Any
) -> Sidecar:
    """Commit a slot filled from elsewhere (a replica, a restore transfer, a download):
    every checksum verified first, then rename and sidecar, exactly like a local save.
    ``verified``: the caller already checked every chunk of the very bytes it wrote into
    the slot (a restore hashes them as they land), so they are not read again here.
    The paths are derived here from the step, never taken from the sender."""
    if not verified:
        verify(slot.mm if slot.mm is not None else b"", sc.checksum, where)
    # The slot holds bytes of its own now: where the sender's record kept them (a shared
    # copy's ``shared_with``, a replica's ``replica_on``) says nothing about this copy. A
    # kept ``shared_with`` sent every reader to a neighbour's file that is not on this node.
    own = {k: v for k, v in sc.extra.items() if k not in _WHERE_KEPT}
    changes: dict[str, Any] = {"shard": step_file(sc.step), "extra": {**own, **extra}}
    if node is not None:
        changes["node"] = node
    committed = dataclasses.replace(sc, **changes)
    path = os.path.join(ring.folder, sidecar_file(sc.step))
    ring.commit(slot, sc.step, lambda: reserve.write_or_spend(lambda: write_sidecar(path, committed), os.path.dirname(ring.folder)))
    return committed
