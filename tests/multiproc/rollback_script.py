"""load(state, step=N) mid-run on two nodes: a rollback. Run by test_rollback.py.

    python rollback_script.py OUT_DIR

Two ranks save steps 2, 4, 6 and 8 (each durable, each with a replica on the other
node), then roll back with load(state, step=4), save step 5, and close. A new
Checkpointer's plain load() must then restore step 5 - the timeline the rollback began -
not step 8. Writes ``OUT_DIR/result-r{rank}.json``: what each load() returned, whether the
state held the expected values after each, and each save's outcome.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    base = torch.arange(4096, dtype=torch.float32) + 1000 * rank
    state = {"w": base.clone(), "extra": {"step": -1}}

    def at(step: int) -> torch.Tensor:
        return base + step

    try:
        with incluster.Checkpointer(job="rollback", replicas=1, keep=4, slot_timeout_s=30) as ck:
            for step in (2, 4, 6, 8):
                state["w"].copy_(at(step))
                state["extra"]["step"] = step
                ck.save(step, state).wait()
                res[str(step)] = "durable"
            state["w"].zero_()
            res["rollback"] = ck.load(state, step=4)
            res["rollback_values"] = torch.equal(state["w"], at(4)) and state["extra"]["step"] == 4
            state["w"].copy_(at(5))
            state["extra"]["step"] = 5
            ck.save(5, state).wait()
            res["5"] = "durable"
        state = {"w": torch.zeros(4096), "extra": {}}
        with incluster.Checkpointer(job="rollback", replicas=1, keep=4, slot_timeout_s=30) as ck:
            res["reload"] = ck.load(state)
            res["reload_values"] = torch.equal(state["w"], at(5)) and state["extra"]["step"] == 5
    except Exception as exc:  # noqa: BLE001 - reported in the result
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
