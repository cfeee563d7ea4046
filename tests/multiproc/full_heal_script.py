"""A restore whose receiving node has no room for its copy still restores.

    python full_heal_script.py OUT_DIR PHASE     (2 ranks, 2 nodes, replicas=1)

PHASE ``save``: both ranks save step 2 (durable, with replicas) and exit. The test then
deletes node n1's RAM folder (the node was replaced) and starts PHASE ``load`` with a
full RAM disk on rank 1 for step 2 (an ``enospc`` fault where its slot file grows):
rank 1 receives its shard from n0, which must land verified in the live state even
though n1's copy cannot be written, and no rank may hang. Both then save step 3.
Writes ``OUT_DIR/result-r{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    out_dir, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    want = torch.arange(50_000, dtype=torch.float32) * (rank + 1)
    ck = incluster.Checkpointer(job="fullheal", replicas=1, slot_timeout_s=30)
    res: dict = {}
    try:
        if phase == "save":
            ck.save(2, {"w": want.clone()}).wait(60)
        else:
            state = {"w": torch.zeros_like(want)}
            res["loaded"] = ck.load(state)
            res["equal"] = bool(torch.equal(state["w"], want))
            res["source"] = ck.last_restore.source if ck.last_restore else None
            state["w"] += 1
            ck.save(3, state).wait(60)
            res["step3"] = "durable"
    finally:
        ck.close()
    with open(os.path.join(out_dir, f"result-{phase}-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
