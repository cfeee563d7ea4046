"""A persistent tier slow for rank 0 must not hold up any rank's saves.

    python slow_tier_script.py OUT_DIR TIER_DIR LATENCY_S     (2 ranks, 2 nodes)

Every save is due for upload (``persistent_every=1``); rank 0's tier answers each call
LATENCY_S late, so its upload of step 1 runs long while the ranks save steps 2-6: those
uploads are skipped, and the saves to RAM must go on meanwhile, on every rank. Rank 1's
upload of step 1 waits on the job store for rank 0 (its gate, then the step's outcome)
all that time. Writes ``OUT_DIR/result-r{rank}.json``: per step, how long ``save()``
blocked and how long until the step was durable.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import incluster
from incluster.testing import SlowTier
from incluster.tiers.persistent import FsspecTier


def main() -> int:
    out_dir, tier_dir, latency = sys.argv[1], sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier = SlowTier(FsspecTier(tier_dir), latency_s=latency) if rank == 0 else tier_dir
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="slowtier", replicas=0, persistent=tier, persistent_every=1, slot_timeout_s=60)
    res: dict = {"blocked": [], "durable": []}
    try:
        for step in range(1, 7):
            state["w"] += 1
            t0 = time.monotonic()
            h = ck.save(step, state)
            res["blocked"].append(time.monotonic() - t0)
            h.wait(120)
            res["durable"].append(time.monotonic() - t0)
            time.sleep(0.2)
    finally:
        ck.close()
    with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
