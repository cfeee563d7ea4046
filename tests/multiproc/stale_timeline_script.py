"""One run of a job whose nodes come and go. Run by test_stale_timeline.py.

    python stale_timeline_script.py OUT_DIR PHASE

PHASE "first": save steps 10, 15 and 20, each durable. "second": load(), then train
differently (another increment) and save step 20 again. "third": load() only. Writes
``OUT_DIR/PHASE-r{rank}.json``: what load() returned, and a digest of the state at each
save and after the load.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

import incluster


def digest(state: dict) -> str:
    return hashlib.sha256(state["w"].numpy().tobytes() + json.dumps(state["extra"]).encode()).hexdigest()[:16]


def main() -> int:
    out_dir, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.zeros(20_000) + rank, "extra": {"step": -1}}
    res: dict = {"saved": {}}
    ck = incluster.Checkpointer(job="stale", replicas=1, slot_timeout_s=30)
    try:
        steps, bump = [10, 15, 20], 1.0
        if phase != "first":
            res["load"] = ck.load(state)
            res["after_load"] = digest(state)
            steps, bump = [s for s in (18, 20) if s > (res["load"] or -1)], 100.0
        if phase != "third":
            for step in steps:
                state["w"] += bump
                state["extra"]["step"] = step
                ck.save(step, state).wait()
                res["saved"][str(step)] = digest(state)
    finally:
        ck.close()
        with open(os.path.join(out_dir, f"{phase}-r{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
