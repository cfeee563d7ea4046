"""Gather one small record per rank to rank 0 (and scatter one back) in O(W) bytes in all.

``torch.distributed.gather_object`` all-gathers every rank's object size first (W int64s
to each of W ranks: O(W^2) bytes in all) and pads every object to the largest. Here each
rank sends rank 0 its own length, then its own pickled bytes, point to point: 2(W-1)
messages into rank 0 and nothing else moves. Records travel as JSON, not pickle: what a
peer sends is data (tuples arrive as lists), never code.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


MAX_RECORD = 64 << 20  # bytes: a per-rank record far larger than this is not a record


def active_dist() -> Any:
    """``torch.distributed`` when a group of more than one rank is up, else None."""
    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def device_for_collectives() -> torch.device:
    """Where tensors for the default group's collectives live (CUDA under NCCL)."""
    if dist.get_backend() == "nccl":
        return nccl_device()
    return torch.device("cpu")


def nccl_device() -> torch.device:
    """The GPU of this rank's NCCL communicator: the one ``init_process_group(device_id=)``
    bound the default group to, else the current device (NCCL's own convention)."""
    try:
        bound = dist.distributed_c10d._get_default_group().bound_device_id
    except (AttributeError, RuntimeError, ValueError):
        bound = None
    if bound is not None and bound.type == "cuda" and bound.index is not None:
        return bound
    return torch.device("cuda", torch.cuda.current_device())


def _run(ops: list[Any]) -> None:
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()


def gather_to_zero(obj: Any, rank: int, world: int) -> list[Any] | None:
    """Rank 0 gets ``[obj of rank 0, ..., obj of rank W-1]`` (JSON round-tripped: tuples
    arrive as lists); the others get None."""
    if world == 1:
        return [obj]
    dev = device_for_collectives()
    data = json.dumps(obj, separators=(",", ":")).encode()
    if rank != 0:
        _run([dist.P2POp(dist.isend, torch.tensor([len(data)], dtype=torch.int64, device=dev), 0)])
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        _run([dist.P2POp(dist.isend, payload, 0)] if len(data) else [])
        return None
    lens = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    _run([dist.P2POp(dist.irecv, lens[r], r) for r in range(1, world)])
    sizes = [int(x.item()) for x in lens]
    bad = [r for r in range(1, world) if not 0 <= sizes[r] <= MAX_RECORD]
    if bad:
        raise ValueError(f"rank(s) {bad} announced records over {MAX_RECORD} bytes; refused before allocating")
    bufs = [torch.empty(sizes[r], dtype=torch.uint8, device=dev) for r in range(world)]
    _run([dist.P2POp(dist.irecv, bufs[r], r) for r in range(1, world) if sizes[r]])
    out: list[Any] = [json.loads(data)]
    for r in range(1, world):
        out.append(json.loads(bufs[r].cpu().numpy().tobytes()))
    return out


def scatter_from_zero(objs: list[Any] | None, rank: int, world: int) -> Any:
    """Rank 0 sends rank r ``objs[r]`` (JSON: data, never pickle - unlike
    ``scatter_object_list``); every rank returns its own. Point to point, O(W) in all."""
    if world == 1:
        return json.loads(json.dumps(objs[0])) if objs else None
    dev = device_for_collectives()
    if rank == 0:
        if objs is None or len(objs) != world:
            raise ValueError(f"rank 0 must give one record per rank ({world})")
        datas = [json.dumps(o, separators=(",", ":")).encode() for o in objs]
        lens = [torch.tensor([len(d)], dtype=torch.int64, device=dev) for d in datas]
        _run([dist.P2POp(dist.isend, lens[r], r) for r in range(1, world)])
        bufs = [torch.frombuffer(bytearray(d), dtype=torch.uint8).to(dev) for d in datas]
        _run([dist.P2POp(dist.isend, bufs[r], r) for r in range(1, world) if len(datas[r])])
        return json.loads(datas[0])
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    _run([dist.P2POp(dist.irecv, n, 0)])
    size = int(n.item())
    if not 0 < size <= MAX_RECORD:
        raise ValueError(f"rank 0 announced a {size}-byte record (at most {MAX_RECORD})")
    buf = torch.empty(size, dtype=torch.uint8, device=dev)
    _run([dist.P2POp(dist.irecv, buf, 0)])
    return json.loads(buf.cpu().numpy().tobytes())
