"""Saves with keep=4 onto a RAM disk with room for two slots; run by test_ram_disk_full.py.
With ``regrow``, a filler file takes the room first and goes after the ring shrank.

    python small_ram_disk_script.py DIR RESULT.json [regrow]
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

import incluster


def main() -> int:
    folder, result_path = sys.argv[1], sys.argv[2]
    regrow = sys.argv[3:] == ["regrow"]
    out: dict = {"saves": {}, "slots_after": {}}
    state = {"w": torch.zeros(1 << 18), "extra": {"step": 0}}  # 1 MiB
    filler = os.path.join(folder, "filler")
    if regrow:  # 4 of the 8 MiB: room for two slots beside the reserve
        logging.basicConfig(level=logging.INFO)
        with open(filler, "wb") as f:
            f.write(b"\1" * (4 << 20))
    steps = 10 if regrow else 6
    with incluster.Checkpointer(local_dir=folder, job="small", writer="thread", keep=4, slot_timeout_s=20) as ck:
        for step in range(1, steps + 1):
            state["w"] += 1
            state["extra"]["step"] = step
            try:
                ck.save(step, state).wait()
                out["saves"][step] = "durable"
            except incluster.CheckpointError as exc:
                out["saves"][step] = [type(exc).__name__, str(exc)]
            out["slots_after"][step] = len(ck.ring.slots)
            if regrow and step == 4:
                os.unlink(filler)  # the room is back
        out["slots"] = len(ck.ring.slots)
        out["held"] = sorted(s.step for s in ck.ring.slots if s.step is not None)
    fresh = {"w": torch.zeros(1 << 18), "extra": {}}
    with incluster.Checkpointer(local_dir=folder, job="small", writer="thread", keep=4) as ck:
        out["loaded"] = ck.load(fresh)
        out["bitwise"] = torch.equal(fresh["w"], torch.full((1 << 18,), float(steps)))
    with open(result_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
