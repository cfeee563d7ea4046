"""Moving shards between ranks during a restore, over the job's default process group.

Metadata first (sidecar length and shard size), then the sidecar and the raw shard,
all posted at once with ``batch_isend_irecv`` so every rank's sends and receives run
together. The receiver lands the bytes straight in one of its own slot files (healing
its node's RAM tier on the way) and verifies them before anything uses them.

gloo moves CPU tensors: the sender's mapped file goes out as is. NCCL moves GPU tensors:
the sender stages file -> GPU, the receiver GPU -> its slot file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from incluster.errors import CorruptCheckpointError
from incluster.format.sidecar import Sidecar
from incluster.staging.slots import SlotRing
from incluster.tiers.local import ShardReader
from incluster.writer.local_commit import commit_received, parse_received_sidecar

_MAX_SIDECAR = 256 * 1024 * 1024


@dataclass
class Outgoing:
    dst: int
    sidecar: bytes
    reader: ShardReader  # verified, mapped


def _wire(t: torch.Tensor) -> torch.Tensor:
    if dist.get_backend() == "nccl":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def _empty(n: int) -> torch.Tensor:
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return torch.empty(n, dtype=torch.uint8, device=dev)


def exchange(
    rank: int,
    step: int,
    source: int | None,
    outgoing: list[Outgoing],
    ring: SlotRing,
    *,
    job: str,
    node: str,
    timeout_s: float,
    slot: Any = None,
) -> tuple[str | None, tuple[str, Sidecar, torch.Tensor] | None]:
    """Send ``outgoing`` and, if ``source`` is set, receive this rank's shard from it
    (into ``slot`` when the caller prepared one).

    Returns (why the received copy is unusable, or None; and on success the committed
    shard's path, sidecar and mapped bytes, to load from without mapping it again).
    """
    ops = []
    lens = _wire(torch.zeros(2, dtype=torch.int64))
    if source is not None:
        ops.append(dist.P2POp(dist.irecv, lens, source))
    for o in outgoing:
        h = torch.tensor([len(o.sidecar), o.reader.nbytes], dtype=torch.int64)
        ops.append(dist.P2POp(dist.isend, _wire(h), o.dst))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    lens = lens.cpu()
    sc_len, size = int(lens[0]), int(lens[1])
    ops, sc_buf, wire_buf = [], None, None
    problem = None
    if source is not None:
        if not (0 < sc_len <= _MAX_SIDECAR and size >= 0):
            problem = f"rank {source} announced a {sc_len}-byte sidecar and a {size}-byte shard"
        else:
            if slot is None:
                slot = ring.acquire(step, timeout_s)
            buf = ring.prepare(slot, size)
            sc_buf = _empty(sc_len)
            wire_buf = _empty(size) if dist.get_backend() == "nccl" else buf
            ops.append(dist.P2POp(dist.irecv, sc_buf, source))
            if size:
                ops.append(dist.P2POp(dist.irecv, wire_buf, source))
    for o in outgoing:
        ops.append(dist.P2POp(dist.isend, _wire(torch.frombuffer(bytearray(o.sidecar), dtype=torch.uint8)), o.dst))
        if o.reader.nbytes:
            ops.append(dist.P2POp(dist.isend, _wire(o.reader.raw()), o.dst))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    if source is None or problem is not None or slot is None or sc_buf is None:
        if slot is not None:
            ring.release(slot)
        return problem, None
    if wire_buf is not None and wire_buf.device.type == "cuda":
        ring.prepare(slot, size).copy_(wire_buf)
    try:
        sc = _commit(rank, step, ring, slot, bytes(sc_buf.cpu().numpy()), size, job=job, node=node, source=source)
    except CorruptCheckpointError as exc:
        ring.release(slot)
        return str(exc), None
    return None, (slot.path, sc, ring.prepare(slot, size))


def _commit(rank: int, step: int, ring: SlotRing, slot: Any, raw: bytes, size: int, *, job: str, node: str, source: int) -> Sidecar:
    where = f"rank {rank}'s shard of step {step} received from rank {source}"
    sc = parse_received_sidecar(raw, where, rank=rank, step=step, job=job, size=size)
    return commit_received(ring, slot, sc, where, node=node, restored_from_rank=source)
