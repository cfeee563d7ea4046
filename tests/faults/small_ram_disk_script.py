"""Saves with keep=4 onto a RAM disk with room for two slots; run by test_ram_disk_full.py.

    python small_ram_disk_script.py DIR RESULT.json
"""

from __future__ import annotations

import json
import sys

import torch

import incluster


def main() -> int:
    folder, result_path = sys.argv[1], sys.argv[2]
    out: dict = {"saves": {}}
    state = {"w": torch.zeros(1 << 18), "extra": {"step": 0}}  # 1 MiB
    with incluster.Checkpointer(local_dir=folder, job="small", writer="thread", keep=4, slot_timeout_s=20) as ck:
        for step in range(1, 7):
            state["w"] += 1
            state["extra"]["step"] = step
            try:
                ck.save(step, state).wait()
                out["saves"][step] = "durable"
            except incluster.CheckpointError as exc:
                out["saves"][step] = [type(exc).__name__, str(exc)]
        out["slots"] = len(ck.ring.slots)
    fresh = {"w": torch.zeros(1 << 18), "extra": {}}
    with incluster.Checkpointer(local_dir=folder, job="small", writer="thread", keep=4) as ck:
        out["loaded"] = ck.load(fresh)
        out["bitwise"] = torch.equal(fresh["w"], torch.full((1 << 18,), 6.0))
    with open(result_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
