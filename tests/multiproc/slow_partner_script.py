"""A partner slow to replicate must not hold up this rank's next local commits.

    python slow_partner_script.py OUT_DIR        (2 ranks, 2 nodes, replicas=1)

Rank 1's writer sleeps (a ``slow`` fault) before exchanging step 1's replicas. Both ranks
save steps 1, 2 and 3 back to back; rank 0 records how long after ``save(3)`` its own
commit record of step 3 appeared in its RAM folder. Then every step must still become
durable on both ranks. Writes ``OUT_DIR/result-r{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import incluster
from incluster.staging.slots import sidecar_file


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="slowpartner", replicas=1, keep=4, slot_timeout_s=60,
                                writer=os.environ.get("WRITER", "process"))
    res: dict = {}
    try:
        handles = []
        for step in (1, 2, 3):
            handles.append(ck.save(step, state))
            ck.wait_staged()
        t0 = time.monotonic()
        path = os.path.join(ck.folder, sidecar_file(3))
        while not os.path.exists(path) and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        res["local3_s"] = time.monotonic() - t0
        for h in handles:
            h.wait(120)
        res["durable"] = [h.step for h in handles]
    finally:
        ck.close()
    with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
