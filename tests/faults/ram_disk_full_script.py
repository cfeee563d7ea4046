"""Saves onto a RAM disk that fills up; run by test_ram_disk_full.py.

    python ram_disk_full_script.py DIR RESULT.json fill|inject

``fill``: DIR is a small tmpfs of its own; after the first save a filler file takes every
free byte. ``inject``: no such mount is possible here, so the allocation of step 2's slot
fails with ENOSPC through INCLUSTER_FAULTS instead. Either way the state then grows, so
step 2 needs a bigger slot than the ones already allocated.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import incluster


def main() -> int:
    folder, result_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    out: dict = {}
    state = {"w": torch.arange(65536, dtype=torch.float32), "extra": {"step": 1}}
    ck = incluster.Checkpointer(local_dir=folder, job="full", writer="thread", slot_timeout_s=20)
    ck.save(1, state).wait()
    ck.prepare(state).result(20)  # every slot allocated before the disk fills (no race with it)
    if mode == "fill":
        with open(os.path.join(folder, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as exc:
                out["filled"] = exc.errno
    state["grow"] = torch.ones(65536)  # a bigger state needs a bigger slot
    state["extra"]["step"] = 2
    try:
        ck.save(2, state).wait()
        out["step2"] = "durable"
    except incluster.CheckpointError as exc:
        out["step2"] = [type(exc).__name__, str(exc)]
    ck.close()
    del state["grow"]
    fresh = {"w": torch.zeros(65536), "extra": {}}
    with incluster.Checkpointer(local_dir=folder, job="full", writer="thread") as ck:
        out["loaded"] = ck.load(fresh)  # nothing committed was lost
        out["bitwise"] = torch.equal(fresh["w"], torch.arange(65536, dtype=torch.float32))
        for step in (3, 4):  # training goes on; the disk is freed between the two saves
            fresh["w"] += 1
            fresh["extra"]["step"] = step
            try:
                ck.save(step, fresh).wait()
                out[f"step{step}"] = "durable"
            except incluster.CheckpointError as exc:
                out[f"step{step}"] = [type(exc).__name__, str(exc)]
            if os.path.exists(os.path.join(folder, "filler")):
                os.unlink(os.path.join(folder, "filler"))
    out["reserve_back"] = os.path.getsize(os.path.join(folder, "full", ".reserve-00000")) >= 1 << 20
    with open(result_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
