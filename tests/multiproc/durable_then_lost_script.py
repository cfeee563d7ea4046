"""Rank 0 ends (SIGKILL) right after a step was durable. Run by test_durable_then_lost.py.

    python durable_then_lost_script.py save OUT_DIR   # steps 1-3; rank 0 dies once 3 is durable
    python durable_then_lost_script.py load OUT_DIR   # every rank restores; writes the step

The job store lives in rank 0's process, so rank 1 may still be waiting for step 3's
outcome when it goes: the step rank 0 was told is durable must survive that.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    mode, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.zeros(4096)}
    ck = incluster.Checkpointer(job="lost", replicas=1, slot_timeout_s=20, writer=os.environ.get("WRITER", "process"))
    if mode == "load":
        step = ck.load(state)
        ok = step is not None and bool(torch.all(state["w"] == step * 10 + rank))
        with open(os.path.join(out_dir, f"loaded-r{rank}"), "w") as f:
            f.write(f"{step} {ok}")
        ck.close()
        return 0
    for step in (1, 2, 3):
        state["w"].fill_(step * 10 + rank)
        h = ck.save(step, state)
        if step < 3 or rank == 0:
            h.wait()
    if rank == 0:  # step 3 is durable here: a restart must find it
        os.kill(os.getpid(), signal.SIGKILL)
    try:  # rank 1 learns what it can of step 3 (the store is gone), then ends too
        h.wait(60)
    except incluster.CheckpointError as exc:
        print(f"rank 1: {exc}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
