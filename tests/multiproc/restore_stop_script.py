"""One rank of a restore that one rank cannot finish like the others (test_restore_stop.py).

    restore_stop_script.py OUT_DIR PHASE CASE [TIER]

PHASE "save" saves step 2 (and waits until it is persisted when TIER is given); "load"
restores it and writes OUT_DIR/result-load-r<rank>.json: the step loaded and whether it is
bitwise the saved state, or the error and how long load() took. CASE "shape": rank 1's
live state has another shape; "object": the state also holds an object whose
``load_state_dict`` refuses on the last rank (a restore into more ranks: resharded). Rank 1
stays alive KEEP seconds after its load()."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import incluster


class Counter:
    """A Stateful object; on the last rank of a load it refuses what it is given."""

    def __init__(self, refuse: bool) -> None:
        self.n, self.refuse = 3, refuse

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if self.refuse:
            raise ValueError("this counter takes no saved value")
        self.n = sd["n"]


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
            h = ck.save(2, {"w": want.clone(), "c": Counter(False)} if case == "object" else {"w": want.clone()})
            h.wait(60)
            if tier is not None:
                assert h.persisted.result(60)
            return 0
        size = want.numel() + 1 if case == "shape" and rank == 1 else want.numel()
        state: dict[str, object] = {"w": torch.zeros(size)}
        if case == "object":  # more ranks than saved: each takes its own old rank's values (rank % old world)
            state = {"w": torch.zeros(size), "c": Counter(rank == dist.get_world_size() - 1)}
            want = torch.arange(50_000, dtype=torch.float32) * (rank % 2 + 1)
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
