"""Time-based persistent saves: no writer waits for rank 0's current commit.

    python persist_interval_script.py OUT_DIR PERSIST_DIR     (2 ranks, 2 nodes)

``persistent_interval_s=1``; rank 0's commit of step 3 is slow (a ``slow`` fault in the
test's environment). Both ranks save steps 1-6, 0.4 s apart; each records how long after
``save(4)`` its own commit record of step 4 appeared, and which steps ``persisted``.
Writes ``OUT_DIR/result-r{rank}.json``.
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
    out_dir, persist = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="interval", replicas=1, persistent=persist, persistent_interval_s=1.0,
                                keep=4, slot_timeout_s=60, writer=os.environ.get("WRITER", "process"))
    res: dict = {}
    ck.prepare(state).result(120)  # the writer is up: step 4's timing is its commit's, not the writer's start
    try:
        handles = []
        for step in range(1, 7):
            handles.append(ck.save(step, state))
            if step == 4:
                t0 = time.monotonic()
                path = os.path.join(ck.folder, sidecar_file(4))
                while not os.path.exists(path) and time.monotonic() - t0 < 60:
                    time.sleep(0.01)
                res["local4_s"] = time.monotonic() - t0
            time.sleep(0.4)
        for h in handles:
            h.wait(120)
        res["persisted"] = [h.step for h in handles if h.persisted.result(120)]
    finally:
        ck.close()
    with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
