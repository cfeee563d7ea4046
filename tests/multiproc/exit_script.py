"""Ranks that leave without close().

    python exit_script.py        (2 ranks, 2 nodes, replicas=1)

Both save step 5. Then rank 1's training code raises (nothing of its own in flight) and
rank 0 saves step 10 and leaves with an error too, without close(): its exit drains step
10, which fails (its partner is gone), and it checks out of the job store it hosts only
once every rank has checked out - rank 1 must have done so on its way out.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="exits", replicas=1, slot_timeout_s=90)
    ck.save(5, state).wait(60)
    dist.barrier()
    if rank == 1:
        raise RuntimeError("the training code failed on rank 1")
    ck.save(10, state)
    return 3  # rank 0 fails too (its collectives would): no close()


if __name__ == "__main__":
    sys.exit(main())
