"""Rank 0 (the job store's host) is SIGKILLed at step 3; rank 1 saves on, then closes.

    python store_lost_script.py OUT_DIR [early]     (2 ranks, 2 nodes)

``early``: rank 0 is SIGKILLed as soon as both ranks made their Checkpointer, while
rank 1's writer process is still starting (it connects to the store as it starts).

Writes ``OUT_DIR/result-r1.json``: each later save's error and how long close() took.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import incluster


def main() -> int:
    out_dir, early = sys.argv[1], sys.argv[2:] == ["early"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.zeros(1 << 12)}
    ck = incluster.Checkpointer(job="lost", replicas=1, slot_timeout_s=20)
    if early:
        dist.barrier()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    else:
        ck.prepare(state).result(60)
    res: dict = {"errors": {}}
    for step in range(8):
        state["w"] += 1
        if rank == 0 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            ck.save(step, state).wait(30)
        except incluster.CheckpointError as exc:
            res["errors"][step] = f"{type(exc).__name__}: {exc}"
        res.setdefault("took", {})[step] = time.monotonic() - t0
        time.sleep(0.1)
    t0 = time.monotonic()
    ck.close()
    res["close_s"] = time.monotonic() - t0
    with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
