"""A forwarding round of a restore: sidecars go where identical bytes are.

The plan (:mod:`incluster.recovery.equivalent`) names, for each shard with no usable
copy left, a rank that keeps its sidecar and a rank on a node holding another rank's
byte-identical shard of the step. The sidecar moves point to point (sizes, then bytes,
each posted at once with ``batch_isend_irecv``); the receiver checks it is the named
rank's sidecar of this step and job and that its whole checksum record equals that of
the bytes on its node, then commits it there as a shared copy pointing at those bytes.
Nothing is trusted on the strength of the digest alone, and the next round still checks
every chunk as it is restored.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from incluster import reserve
from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.format.checksum import content_id
from incluster.format.sidecar import MAX_SIDECAR_BYTES, open_regular, read_sidecar, write_sidecar
from incluster.recovery.equivalent import SIDECAR_BAD
from incluster.recovery.node import BAD_SUFFIX
from incluster.recovery.gather import _run, device_for_collectives
from incluster.recovery.plan import RankPlan
from incluster.staging.slots import sidecar_file
from incluster.tiers.local import data_path, rank_folder
from incluster.writer.local_commit import parse_received_sidecar

log = logging.getLogger("incluster")
Bad = tuple[str, int, int]
Healed = tuple[str, int, int, int, int, int, str]  # node, owner, step, bytes, world, content, sidecar's node


def forward_sidecars(ctx: Any, mine: RankPlan) -> tuple[list[Healed], list[Bad]]:
    """Run my part of a forwarding round: the copies I committed (for rank 0's next
    plan) and the sidecars or copies I found unusable."""
    step = mine.step
    if step is None:
        raise CheckpointError("a forwarding round without a step; please report this")
    bad: list[Bad] = []
    out, local = [], {}
    for owner, dst in mine.forward_send:
        raw = _read(rank_folder(ctx.local_dir, ctx.job, owner), step)
        if not raw:
            log.warning("incluster: rank %d: rank %d's sidecar of step %d on %s cannot be read", ctx.rank, owner, step, ctx.node)
            bad.append((SIDECAR_BAD + ctx.node, owner, step))
        if dst == ctx.rank:
            local[owner] = raw  # the sidecar and the identical bytes are both on my node
        else:
            out.append((dst, raw))
    remote = [rec for rec in mine.forward_recv if rec[1] != ctx.rank]
    got = iter(_exchange(out, remote))
    received = [(rec, local.get(rec[0], b"") if rec[1] == ctx.rank else next(got)) for rec in mine.forward_recv]
    healed: list[Healed] = []
    for (owner, _, bytes_of, from_node), raw in received:
        if not raw:
            continue  # its sender could not read it, and said so
        try:
            healed.append(_commit(ctx, step, owner, bytes_of, raw) + (from_node,))
        except _PeerCopyBad as exc:
            log.warning("incluster: rank %d: %s", ctx.rank, exc)
            bad.append((ctx.node, bytes_of, step))
        except OSError as exc:  # my own write (a full RAM disk): not the sidecar's fault
            log.warning("incluster: rank %d: rank %d's step %d cannot be rebuilt on %s (%s)", ctx.rank, owner, step, ctx.node, exc)
            bad.append((ctx.node, owner, step))
        except CorruptCheckpointError as exc:
            log.warning("incluster: rank %d: rank %d's sidecar of step %d from %s is unusable (%s)",
                        ctx.rank, owner, step, from_node, exc)
            bad.append((SIDECAR_BAD + from_node, owner, step))
    return healed, bad


def _exchange(out: list[tuple[int, bytes]], remote: list[tuple[int, int, int, str]]) -> list[bytes]:
    """Sizes, then bytes, point to point; nothing to move (a single process, or every
    sidecar already on its receiver's node) touches no process group."""
    if not out and not remote:
        return []
    dev = device_for_collectives()
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in remote]
    ops = [dist.P2POp(dist.isend, torch.tensor([len(raw)], dtype=torch.int64, device=dev), dst) for dst, raw in out]
    ops += [dist.P2POp(dist.irecv, t, rec[1]) for t, rec in zip(sizes, remote)]
    _run(ops)
    ns = [int(t.item()) for t in sizes]
    if any(not 0 <= n <= MAX_SIDECAR_BYTES for n in ns):
        raise CheckpointError(f"a peer announced a sidecar of {max(ns)} bytes (cap {MAX_SIDECAR_BYTES}); refused before allocating")
    bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in ns]
    ops = [dist.P2POp(dist.isend, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev), dst) for dst, raw in out if raw]
    ops += [dist.P2POp(dist.irecv, b, rec[1]) for b, rec in zip(bufs, remote) if b.numel()]
    _run(ops)
    return [b.cpu().numpy().tobytes() for b in bufs]


class _PeerCopyBad(Exception):
    """The identical copy on this node is not there or not what the inventory said."""


def _commit(ctx: Any, step: int, owner: int, bytes_of: int, raw: bytes) -> tuple[str, int, int, int, int, int]:
    """Check the received sidecar against the copy of ``bytes_of`` on this node and commit
    it as a shared copy of ``owner``'s shard whose bytes are that copy's."""
    peer_folder = rank_folder(ctx.local_dir, ctx.job, bytes_of)
    try:
        peer = read_sidecar(os.path.join(peer_folder, sidecar_file(step)))
        path = data_path(peer_folder, peer)
        size = os.stat(path).st_size
    except (CorruptCheckpointError, OSError) as exc:
        raise _PeerCopyBad(f"rank {bytes_of}'s copy of step {step} on {ctx.node} is gone or unreadable ({exc})") from None
    if peer.job != ctx.job or peer.step != step or size != peer.checksum.size:
        raise _PeerCopyBad(f"rank {bytes_of}'s copy of step {step} on {ctx.node} does not match its sidecar")
    where = f"rank {owner}'s sidecar of step {step} (forwarded to rank {ctx.rank})"
    sc = parse_received_sidecar(raw, where, rank=owner, step=step, job=ctx.job, size=size)
    if sc.checksum != peer.checksum:  # the digests matched; the records must too
        raise CorruptCheckpointError(f"{where}: its checksums differ from rank {bytes_of}'s shard on {ctx.node}")
    holder = int(os.path.basename(os.path.dirname(path))[5:])  # the rank whose file the bytes are
    folder = rank_folder(ctx.local_dir, ctx.job, owner)
    os.makedirs(folder, exist_ok=True)
    extra = {**sc.extra, "replica_on": ctx.node, "shared_with": holder}
    rebuilt = dataclasses.replace(sc, extra=extra)
    path = os.path.join(folder, sidecar_file(step))
    reserve.write_or_spend(lambda: write_sidecar(path, rebuilt), os.path.dirname(folder))
    log.info("incluster: rank %d: rank %d's step %d rebuilt on %s from rank %d's identical shard",
             ctx.rank, owner, step, ctx.node, holder)
    return (ctx.node, owner, step, size, sc.world_size, content_id(sc.checksum))


def _read(folder: str, step: int) -> bytes:
    """A sidecar's raw bytes, or the record a restore set aside with its bad copy
    (``.bad``: its bytes failed, the record may not have); b"" if missing, a link, or
    over the cap."""
    path = os.path.join(folder, sidecar_file(step))
    for name in (path, path + BAD_SUFFIX):
        try:
            fd = open_regular(name, "sidecar")
            break
        except CheckpointError:  # missing, a link, or not a file
            continue
    else:
        return b""
    try:
        if os.fstat(fd).st_size > MAX_SIDECAR_BYTES:
            return b""
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_SIDECAR_BYTES + 1)[:MAX_SIDECAR_BYTES]
    finally:
        os.close(fd)
