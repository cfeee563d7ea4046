"""One rank's save() is refused; the others must learn at once. Run by test_refused_save.py.

    python refused_save_script.py OUT_DIR

Two ranks save step 1; at step 2 rank 1 hands save() a state it refuses (an object it
cannot store), rank 0 a good one; both then save step 3. Writes
``OUT_DIR/result-r{rank}.json``: how long rank 0 waited for step 2's outcome, the errors,
and whether step 3 became durable on both.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="refused", replicas=1, slot_timeout_s=60, writer=os.environ.get("WRITER", "process"))
    try:
        ck.save(1, state).wait()
        t0 = time.monotonic()
        try:
            bad = {"w": state["w"], "x": object()} if rank == 1 else state
            ck.save(2, bad).wait()
            res["step2"] = "durable"
        except incluster.CheckpointError as exc:
            res["step2"] = f"{type(exc).__name__}: {exc}"
        res["step2_s"] = time.monotonic() - t0
        try:
            ck.wait(30)  # the failure reaches the caller once
        except incluster.CheckpointError:
            pass
        state["w"] += 1
        try:
            ck.save(3, state).wait()
            res["step3"] = "durable"
        except incluster.CheckpointError as exc:
            res["step3"] = f"{type(exc).__name__}: {exc}"
    finally:
        ck.close()
        with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
