"""Ranks that leave without close().

    python exit_script.py             (2 ranks, 2 nodes, replicas=1)
    python exit_script.py alone N HOW (2 ranks, no replicas; N: steps rank 1 saves first,
                                       HOW: rank 1 leaves by "raise" or "close")

Default: both save step 5. Then rank 1's training code raises (nothing of its own in
flight) and rank 0 saves step 10 and leaves with an error too, without close(): its exit
drains step 10, which fails (its partner is gone), and it checks out of the job store it
hosts only once every rank has checked out - rank 1 must have done so on its way out.

``alone``: rank 1 saves N steps (0: none), then raises or closes; rank 0 saves the next step, which
no replica exchange ties to rank 1: only the job store can tell rank 0 it never comes.
Rank 0 prints how long its wait took and what it raised, then saves on alone.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    if sys.argv[1:2] == ["alone"]:
        return alone(rank, state, int(sys.argv[2]), sys.argv[3])
    ck = incluster.Checkpointer(job="exits", replicas=1, slot_timeout_s=90)
    ck.save(5, state).wait(60)
    dist.barrier()
    if rank == 1:
        raise RuntimeError("the training code failed on rank 1")
    ck.save(10, state)
    return 3  # rank 0 fails too (its collectives would): no close()


def alone(rank: int, state: dict, saves: int, how: str) -> int:
    ck = incluster.Checkpointer(job="exits-alone", replicas=0, slot_timeout_s=90)
    for i in range(saves):
        ck.save(i * 5, state).wait(60)
    dist.barrier()
    if rank == 1:
        if how == "close":
            ck.close()
            return 0
        raise RuntimeError("the training code failed on rank 1")
    t0 = time.monotonic()
    try:
        ck.save(saves * 5, state).wait(120)
        print("UNEXPECTED: committed", flush=True)
    except incluster.CheckpointError as exc:
        print(f"FAILED after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
