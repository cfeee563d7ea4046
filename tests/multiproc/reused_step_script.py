"""A load() that goes back past a durable step, then the same step numbers saved again.
Run by test_reused_step.py.

    python reused_step_script.py OUT_DIR

Two ranks save steps 2, 4 and 6 (each durable). Every copy of step 6 is then made
unusable (its sidecars removed), so a mid-run load() restores step 4. Both ranks go on
from there: save(6) again, refused on rank 1 (an object it cannot store), then save(8).
Writes ``OUT_DIR/result-r{rank}.json``: what load() returned and each step's outcome
("durable" or the error).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import torch
import torch.distributed as dist

import incluster


def outcome(handle: incluster.SaveHandle | None) -> str:
    if handle is None:
        return "refused"
    try:
        handle.wait()
        return "durable"
    except incluster.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="reused", replicas=1, slot_timeout_s=30, keep=3,
                                writer=os.environ.get("WRITER", "process"))
    try:
        for step in (2, 4, 6):
            state["w"] += 1
            res[str(step)] = outcome(ck.save(step, state))
        dist.barrier()
        for sidecar in glob.glob(os.path.join(os.environ["INCLUSTER_LOCAL_DIR"], "reused", "rank-*",
                                              f"step-{6:012d}.json")):
            os.remove(sidecar)  # this node's copies of step 6, own and replica
        dist.barrier()
        res["load"] = ck.load(state)
        state["w"] += 1
        try:
            h6 = ck.save(6, {"w": state["w"], "x": object()} if rank == 1 else state)
        except incluster.CheckpointError:
            h6 = None
        res["6 again"] = outcome(h6)
        state["w"] += 1
        res["8"] = outcome(ck.save(8, state))
    finally:
        ck.close()
        with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
