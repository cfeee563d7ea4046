"""Run by test_failed_restore.py.

    python failed_restore_script.py OUT_DIR PHASE

PHASE "save": two ranks save steps 25 and 30 (no replicas), each durable. "load": load(),
writing what it raised to ``OUT_DIR/load-r{rank}.txt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    out_dir, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.zeros(20_000) + rank}
    ck = incluster.Checkpointer(job="failed", replicas=0, slot_timeout_s=30)
    said = "loaded"
    try:
        if phase == "save":
            for step in (25, 30):
                state["w"] += 1
                ck.save(step, state).wait()
        else:
            try:
                said = f"loaded {ck.load(state)}"
            except incluster.CheckpointError as exc:
                said = f"{type(exc).__name__}: {exc}"
    finally:
        ck.close()
        with open(os.path.join(out_dir, f"{phase}-r{rank}.txt"), "w") as f:
            f.write(said)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
