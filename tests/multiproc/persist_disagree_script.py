"""``save(step, persist=True)`` on rank 0 only: rank 0 is told at once, not after slot_timeout_s.

    python persist_disagree_script.py OUT_DIR PERSIST_DIR     (2 ranks, 2 nodes)

``persistent_every=100`` (only the run's first save is due; EVERY in the environment
sets it: with 1, step 2 is due anyway and both upload it), ``slot_timeout_s=60``; both
ranks save steps 0-2, rank 0 passing persist=True for step 2. Records how long rank 0's
``persisted`` of step 2 took to resolve and what it said, and how long close() took.
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


def main() -> int:
    out_dir, persist = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="disagree", replicas=0, persistent=persist,
                                persistent_every=int(os.environ.get("EVERY", "100")),
                                slot_timeout_s=60)
    res: dict = {}
    try:
        for step in range(2):
            h = ck.save(step, state)
            h.wait(60)
            h.persisted.result(60)  # one upload at a time: a due step 2 is never skipped behind step 1's
        h = ck.save(2, state, persist=True if rank == 0 else None)
        h.wait(60)
        t0 = time.monotonic()
        try:
            res["persisted"] = h.persisted.result(60)
        except Exception as exc:  # noqa: BLE001 - what the user is told
            res["error"] = f"{type(exc).__name__}: {exc}"
        res["persisted_s"] = time.monotonic() - t0
    finally:
        t0 = time.monotonic()
        ck.close()
        res["close_s"] = time.monotonic() - t0
    with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
