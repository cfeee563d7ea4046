"""One rank of a job that saves, restarts on moved nodes and saves again (test_orphan_sweep.py).

    orphan_sweep_script.py OUT_DIR PHASE

PHASE "first": save steps 2 and 4. "moved": load(), save steps 6 and 8 (each durable) and
write OUT_DIR/moved-r<rank>.json with the step restored. "again": load() only, write it."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    out_dir, phase = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    state = {"w": torch.zeros(20_000)}
    with incluster.Checkpointer(job="sweep", replicas=1, writer="thread", slot_timeout_s=30) as ck:
        restored = None if phase == "first" else ck.load(state)
        steps = {"first": (2, 4), "moved": (6, 8), "again": ()}[phase]
        for step in steps:
            state["w"].fill_(step * 10 + rank)
            ck.save(step, state).wait(60)
    with open(os.path.join(out_dir, f"{phase}-r{rank}.json"), "w") as f:
        json.dump({"restored": restored, "w": float(state["w"][0])}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
