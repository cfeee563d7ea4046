"""One rank of a restore that one rank cannot finish like the others (test_restore_stop.py).

    restore_stop_script.py OUT_DIR PHASE CASE [TIER]

PHASE "save" saves step 2 (and waits until it is persisted when TIER is given); "load"
restores it and writes OUT_DIR/result-load-r<rank>.json: the step loaded and whether it is
bitwise the saved state, or the error and how long load() took. CASE "shape": rank 1's
live state has another shape. Rank 1 stays alive KEEP seconds after its load()."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    out_dir, phase, case = sys.argv[1:4]
    tier = sys.argv[4] if len(sys.argv) > 4 else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))
    rank = dist.get_rank()
    want = torch.arange(50_000, dtype=torch.float32) * (rank + 1)
    ck = incluster.Checkpointer(job="stop", replicas=1, slot_timeout_s=20, writer="thread", persistent=tier)
    res: dict[str, object] = {}
    try:
        if phase == "save":
            h = ck.save(2, {"w": want.clone()})
            h.wait(60)
            if tier is not None:
                assert h.persisted.result(60)
            return 0
        size = want.numel() + 1 if case == "shape" and rank == 1 else want.numel()
        state = {"w": torch.zeros(size)}
        t0 = time.monotonic()
        try:
            res["loaded"] = ck.load(state)
            res["equal"] = bool(torch.equal(state["w"], want))
        except incluster.CheckpointError as exc:
            res["error"] = str(exc)
        res["seconds"] = round(time.monotonic() - t0, 1)
        with open(os.path.join(out_dir, f"result-load-r{rank}.json"), "w") as f:
            json.dump(res, f)
        if rank == 1:
            time.sleep(float(os.environ.get("KEEP", "0")))  # a rank that lingers (logging, a grace period)
    finally:
        ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
