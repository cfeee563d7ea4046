"""Choosing and loading the step to restore, the same on every rank.

1. each rank lists the steps its folder has sidecars for (no file contents read);
2. the lists are gathered to rank 0 (O(W) bytes in all), which keeps the steps every
   rank has, newest first, and broadcasts that one list;
3. for each candidate, every rank verifies its own shard (sidecar, size, checksums,
   header); one all-reduce (MIN) tells whether all ranks can load it; if any cannot,
   every rank moves on to the next candidate together;
4. each rank copies its shard into the live state, and drops local steps newer than
   the restored one (they never committed everywhere).

A step is restored only if every rank verified its copy: never a torn or mixed state.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch

from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.state import load_into
from incluster.tiers.local import ShardReader, committed_steps
from incluster.testing import faults

log = logging.getLogger("incluster")


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def common_steps(inventories: Sequence[Sequence[int]]) -> list[int]:
    """Steps present in every rank's inventory, newest first (pure)."""
    if not inventories:
        return []
    common = set(inventories[0])
    for inv in inventories[1:]:
        common &= set(inv)
    return sorted(common, reverse=True)


def agree_on_candidates(local: list[int]) -> list[int]:
    dist = _dist()
    if dist is None:
        return local
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    box: list[Any] = [None]
    if gathered is not None:
        box[0] = common_steps(gathered)
        have = [r for r, inv in enumerate(gathered) if inv]
        if not box[0] and have:
            log.warning(
                "incluster: ranks %s hold checkpoints but no step is complete on all %d ranks; "
                "starting without a restore", have, len(gathered),
            )
    dist.broadcast_object_list(box, src=0)
    return list(box[0] or [])


def all_ok(ok: bool) -> bool:
    """True iff every rank says ok (one all-reduce; NCCL needs a GPU tensor)."""
    dist = _dist()
    if dist is None:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def restore(
    folder: str,
    state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    job: str,
    allow_pickle: bool,
    discard: Callable[[int], None],
) -> tuple[int | None, int]:
    """Restore the newest step every rank can load; returns (step or None, bytes read)."""
    for step in agree_on_candidates(committed_steps(folder)):
        reader: ShardReader | None = None
        why = ""
        try:
            reader = ShardReader(folder, step)
            sc = reader.sidecar
            if sc.job != job or sc.rank != rank:
                raise CorruptCheckpointError(
                    f"{folder}: step {step} holds job {sc.job!r} rank {sc.rank}, expected job {job!r} "
                    f"rank {rank}; the folder was copied or renamed"
                )
        except CorruptCheckpointError as exc:
            why = str(exc)
        if not all_ok(reader is not None and not why):
            if why:
                log.warning("incluster: rank %d cannot use step %d (%s); trying an older step", rank, step, why)
                discard(step)
            else:
                log.warning("incluster: step %d is not loadable on every rank; trying an older step", step)
            if reader is not None:
                reader.close()
            continue
        if reader is None:  # unreachable: all_ok(True) means this rank opened it
            continue
        with reader:
            if reader.sidecar.world_size != world_size:
                raise CheckpointError(
                    f"step {step} was saved by {reader.sidecar.world_size} ranks but this job has "
                    f"{world_size}; resharding in place is not supported - assemble a full state "
                    f"with `incluster export` and load that"
                )
            faults.check("load", rank, step)
            load_into(state, reader.sidecar.tree, reader.tensor, allow_pickle=allow_pickle)
            return step, reader.nbytes
    return None, 0
