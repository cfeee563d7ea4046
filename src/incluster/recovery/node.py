"""What a restore does to this node's RAM folder: list it, drop abandoned steps, open
the copies it sends. No collectives here."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.recovery.lineage import NONE, Lineage, parse
from incluster.recovery.plan import RankPlan
from incluster.recovery.transfer import Outgoing
from incluster.staging.slots import SlotRing, sidecar_file, step_file
from incluster.format.sidecar import read_sidecar
from incluster.tiers.local import ShardReader, committed_steps, data_path, rank_folder

log = logging.getLogger("incluster")
BAD_SUFFIX = ".bad"  # a commit record set aside with its bad copy
FOLDER = -1  # the inventory's "step" of an item that only says a rank's folder here holds slot files
_SET_ASIDE = re.compile(r"^step-(\d{12,})\.json\.bad$")


def node_inventory(local_dir: str, job: str, since: float = 0.0) -> list[tuple[int, ...]]:
    """(owner rank, step, bytes, world size, content id, *lineage) for every committed shard
    in this node's folder, and (owner, ``FOLDER``, ...) for every rank folder that holds an
    earlier run's slot files (made before ``since``) and no commit record at all - a rank
    that saved here and never committed: names, sizes and the head of each sidecar (world size -1, content
    id 0 and no lineage where it cannot be read: the copy is then tried, and judged, like
    any other; the lineage, see :mod:`incluster.recovery.lineage`). A sidecar
    whose bytes are gone (a shared replica whose peer's file is) is listed with size -1: not
    a copy, but a sidecar a restore can forward to where identical bytes are."""
    base = os.path.join(local_dir, job)
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    out: list[tuple[int, ...]] = []
    for n in names:
        if n.startswith("rank-") and n[5:].isdigit():
            folder = os.path.join(base, n)
            if _never_committed_here(folder, since):  # an earlier run saved for the rank here, committing nothing
                out.append((int(n[5:]), FOLDER, 0, 0, 0, *NONE))
            steps = committed_steps(folder)
            for step in _set_aside(folder, steps):  # records of bad copies: sidecars only
                world, content, lin = _head(os.path.join(folder, sidecar_file(step) + BAD_SUFFIX))
                out.append((int(n[5:]), step, -1, world, content, *lin))
            for step in steps:
                size: int | None
                try:
                    size = os.stat(os.path.join(folder, step_file(step))).st_size
                except FileNotFoundError:
                    size = _shared_size(folder, step)  # a shared replica: the peer's file
                world, content, lin = _head(os.path.join(folder, sidecar_file(step)))
                out.append((int(n[5:]), step, -1 if size is None else size, world, content, *lin))
    return out


def _never_committed_here(folder: str, since: float) -> bool:
    """Whether a rank folder holds slot files (a staging slot, or a shard renamed before its
    record) made before ``since`` - by an earlier run, not this one's prepare() - and no
    commit record, kept or set aside: the rank saved here and never committed a step."""
    try:
        with os.scandir(folder) as entries:
            found = [(e.name, e.stat(follow_symlinks=False).st_mtime) for e in entries]
    except OSError:
        return False
    if any(n.endswith(".json") or n.endswith(".json" + BAD_SUFFIX) for n, _ in found):
        return False
    return any((n.startswith(".staging-") or n.endswith(".safetensors")) and t < since for n, t in found)


def _set_aside(folder: str, committed: list[int]) -> list[int]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    done = set(committed)
    return [s for n in names if (m := _SET_ASIDE.match(n)) and (s := int(m.group(1))) not in done]


def _shared_size(folder: str, step: int) -> int | None:
    """Size of a shared replica's bytes (the data-parallel peer's own file), if it is one."""
    try:
        sc = read_sidecar(os.path.join(folder, sidecar_file(step)))
        path = data_path(folder, sc)
        return os.stat(path).st_size if path != os.path.join(folder, sc.shard) else None
    except (CorruptCheckpointError, OSError):
        return None


_HEAD = re.compile(  # content and lineage right after the world size
    rb'"world_size":\s*(\d{1,9})(?:,\s*"content":\s*(-?\d{1,20}))?'
    rb'(?:,\s*"lineage":\s*\[\s*(\d{1,20}),\s*(\d{1,20}),\s*(-?\d{1,20})\s*\])?\s*[,}]')


def _head(path: str) -> tuple[int, int, Lineage]:
    """The world size, content id and lineage a sidecar records, from its first bytes (the
    writer puts the identity first); -1, 0 and no lineage where they are not there."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return -1, 0, NONE
    m = _HEAD.search(head)
    if not m:
        return -1, 0, NONE
    lin = parse([int(m.group(3)), int(m.group(4)), int(m.group(5))]) if m.group(3) else NONE
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else 0), lin


def _rank_folders(local_dir: str, job: str) -> list[str]:
    """Every rank folder of the job on this node (own, other local ranks', replicas)."""
    base = os.path.join(local_dir, job)
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    return [os.path.join(base, n) for n in names if n.startswith("rank-") and n[5:].isdigit()]


def abandon_newer(local_dir: str, job: str, step: int, ring: SlotRing) -> None:
    """Training continues from ``step``: every copy of a newer step on this node (own
    shards and replicas alike) belongs to an abandoned timeline. Un-commit them all, so
    a later restore can never mix an old-timeline copy with a new one of the same step,
    and replication never declines a new step because a stale copy has its name. Only
    commit markers are removed here: every shard file stays with the ring that owns it
    (mine, another local rank's, a writer's replica ring), which reuses its pages; a
    file no ring holds is cleaned up when a ring adopts the folder."""
    mine = os.path.abspath(ring.folder)
    for folder in _rank_folders(local_dir, job):
        for newer in _set_aside(folder, []):
            if newer > step:  # a record of the abandoned timeline: never forwarded
                try:
                    os.unlink(os.path.join(folder, sidecar_file(newer) + BAD_SUFFIX))
                except (FileNotFoundError, IsADirectoryError):  # a stray folder of that name stays
                    pass
        if os.path.abspath(folder) == mine:
            continue  # my own ring un-committed them (reset_to); their files are its slots
        for newer in committed_steps(folder):
            if newer > step:
                # Only the marker: the step is gone. The shard file may be another local
                # rank's slot (or a writer's replica slot), mapped by its owner, who reuses it.
                try:
                    os.unlink(os.path.join(folder, sidecar_file(newer)))
                except FileNotFoundError:
                    pass


def drop_other_timelines(local_dir: str, job: str, step: int, chosen: Lineage, ring: SlotRing) -> None:
    """The restore chose ``step`` of the ``chosen`` timeline: un-commit every copy on this
    node of the same step number from another timeline (a node that was away when a
    restore went back past it), so nothing combines or forwards it, and the restored
    step's heal and replicas do not meet a stale copy of that name. My own ring is judged
    from its memory first: another rank of this node may unlink my marker before I look,
    and a ring that still thought it held the step would refuse the heal."""
    mine = os.path.abspath(ring.folder)
    if step in ring.committed_steps():
        marker = os.path.join(mine, sidecar_file(step))
        if not os.path.exists(marker) or _head(marker)[2] != chosen:
            log.info("incluster: %s holds step %d of another timeline; un-committed", mine, step)
            ring.discard(step)
    for folder in _rank_folders(local_dir, job):
        marker = os.path.join(folder, sidecar_file(step))
        if os.path.abspath(folder) == mine or not os.path.exists(marker) or _head(marker)[2] == chosen:
            continue
        log.info("incluster: %s holds step %d of another timeline; un-committed", folder, step)
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass


def uncommit(local_dir: str, job: str, owner: int, step: int) -> None:
    """Un-commit a copy on this node found bad: its marker is set aside as
    ``step-N.json.bad`` (the bytes failed; the record may still be good, and a restore can
    forward it to where identical bytes are, see :mod:`incluster.recovery.forward`). The
    shard file stays with whichever ring holds it."""
    path = os.path.join(rank_folder(local_dir, job, owner), sidecar_file(step))
    try:
        os.replace(path, path + BAD_SUFFIX)
    except FileNotFoundError:
        pass


def bad_copy(ctx: Any, report: Any, owner: int, step: int, exc: Exception) -> None:
    log.warning("incluster: rank %d: the copy of rank %d's step %d on node %s is bad (%s); "
                "it is set aside; another copy, or else an older step, is used", ctx.rank, owner, step, ctx.node, exc)
    report.notes.append(f"rank {owner}'s copy on {ctx.node} failed verification ({exc})")


def open_outgoing(ctx: Any, mine: RankPlan, report: Any) -> tuple[list[tuple[str, int, int]], list[Outgoing]]:
    """Open (sidecar and header validated, mapped) every copy this rank sends. Their bytes
    are not hashed here: each receiver checks every chunk as it lands, so a corrupt copy
    is still caught, and reported against this node."""
    bad: list[tuple[str, int, int]] = []
    outgoing: list[Outgoing] = []
    step = mine.step
    if step is None:  # the plan always names a step here
        raise CheckpointError("restore reached a transfer without a chosen step; please report this")
    for owner in mine.sends:
        folder = rank_folder(ctx.local_dir, ctx.job, owner)
        try:
            # gloo reads it once, the receiver checks each chunk; load(step=N), which has no
            # older step to overwrite a bad copy's bytes with, checks it whole before sending
            reader = ShardReader(folder, step, verify_checksum=getattr(ctx, "only_step", None) is not None,
                                 populate=False)
            sc = reader.sidecar
            if sc.rank != owner or sc.job != ctx.job:
                reader.close()
                raise CorruptCheckpointError(f"{folder}: step {step} claims rank {sc.rank} of job {sc.job!r}")
            with open(os.path.join(folder, sidecar_file(step)), "rb") as f:
                outgoing.append(Outgoing(owner, f.read(), reader))
            peer = sc.extra.get("shared_with")
            if peer is not None:
                report.notes.append(f"sent rank {owner}'s shard from the identical shard of rank {peer} on {ctx.node}")
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            bad_copy(ctx, report, owner, step, exc)
            uncommit(ctx.local_dir, ctx.job, owner, step)
            bad.append((ctx.node, owner, step))
    return bad, outgoing
