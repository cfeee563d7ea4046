"""close() catching the persistent tier up, on 2 ranks.

    python close_catch_up_script.py OUT_DIR PERSIST_DIR     (2 ranks, 2 nodes)

``persistent_every=2`` on a slow tier (each operation 0.3 s, rank 1's 0.6 s): steps 0-5
are saved quicker than step 0 uploads, so the uploads of steps 2 and 4 are skipped.
close() uploads step 5 on every rank. Writes ``OUT_DIR/result-r{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import incluster
from incluster.testing import SlowTier
from incluster.tiers.persistent import FsspecTier


def main() -> int:
    out_dir, persist = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier = SlowTier(FsspecTier(persist), latency_s=0.3 * (rank + 1))
    ck = incluster.Checkpointer(job="catch", replicas=1, persistent=tier, persistent_every=2, slot_timeout_s=60,
                                writer=os.environ.get("WRITER", "process"))
    res: dict = {}
    try:
        started = getattr(ck._writer, "started", None)
        if started is not None:  # saves faster than the writer's start would give up their slots
            started.result(60)
        handles = [ck.save(step, {"w": torch.full((4096,), float(10 * step + rank))}) for step in range(6)]
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
