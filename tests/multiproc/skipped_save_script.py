"""Ranks that do not save the same steps. Run by test_skipped_save.py.

    python skipped_save_script.py OUT_DIR

Two ranks save step 2, then: rank 1 skips step 4 (rank 0 saves it); both save 6; rank 1
saves a step 7 that rank 0 does not; both save 8; rank 1 skips steps 9 and 10 and saves
an 11 of its own; both save 12, 14 and 16 (every 2nd save also goes to a persistent
folder, OUT_DIR/tier). Then both save 20, rank 0's staging of it slowed by 2 s, and rank
0's save(22) is refused (an object it cannot store) while 20 still stages; both save 24.
Rank 0 saves a step 26 that rank 1, closing, never saves.
Writes ``OUT_DIR/result-r{rank}.json``: each step's outcome ("durable" or the error),
whether 14 and 16 were persisted, and how long the mismatched part took.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import incluster
from incluster.testing import FaultInjector


def outcome(handle: incluster.SaveHandle | None) -> str | None:
    if handle is None:
        return None
    try:
        handle.wait()
        return "durable"
    except incluster.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:  # a step due for the persistent tier that failed must not hold up a later upload
        handle.persisted.exception(30)


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    FaultInjector().fail_at(phase="stage", rank=0, step=20, action="slow", seconds=2.0).install()
    ck = incluster.Checkpointer(job="skipped", replicas=1, slot_timeout_s=60, writer=os.environ.get("WRITER", "process"),
                                persistent=os.path.join(out_dir, "tier"), persistent_every=2)
    try:
        res["2"] = outcome(ck.save(2, state))
        t0 = time.monotonic()
        # rank 0 calls save() 7 times before step 14, rank 1 6 times
        plan = {4: [0], 6: [0, 1], 7: [1], 8: [0, 1], 9: [0], 10: [0], 11: [1], 12: [0, 1]}
        handles: dict[int, incluster.SaveHandle] = {}
        for step, savers in plan.items():
            state["w"] += 1
            if len(savers) == 2:  # a common step: hear of the earlier ones first (a failed save
                for s in sorted(handles):  # nobody waited for would raise from this save())
                    res[str(s)] = outcome(handles.pop(s))
                res[str(step)] = outcome(ck.save(step, state))
            elif rank in savers:
                handles[step] = ck.save(step, state)
        res["elapsed_s"] = time.monotonic() - t0
        for step in (14, 16):  # one of the two is due for the persistent tier, on both ranks
            state["w"] += 1
            h = ck.save(step, state)
            res[str(step)] = outcome(h)
            res[f"persisted{step}"] = h.persisted.result(60)
        h20 = ck.save(20, state)  # rank 0: still staging when its save(22) is refused
        try:
            h22 = ck.save(22, {"w": state["w"], "x": object()} if rank == 0 else state)
        except incluster.CheckpointError as exc:
            h22, res["22"] = None, f"refused: {exc}"
        res["20"] = outcome(h20)
        res["22"] = outcome(h22) or res["22"]
        res["24"] = outcome(ck.save(24, state))
        if rank == 0:  # rank 1 closes without it
            res["26"] = outcome(ck.save(26, state))
    finally:
        ck.close()
        with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
