"""Data-parallel ranks whose shards are byte-identical share their replicas.

    python dp_share_script.py OUT_DIR PHASE [REPLICAS]    (PHASE: save or load; replicas 2 unless given)

Every rank holds the same model and optimizer (same seed, same data: what data
parallelism keeps identical) plus a value of its own. ``save``: train 2 steps, save step
2 (durable). ``load``: restore into fresh objects, report what came back. Each rank
writes OUT_DIR/result-PHASE-rR.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import incluster


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[float]:
    vals = [p.detach().double().sum().item() for p in model.parameters()]
    vals += [v.double().sum().item() for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
    return vals


def main() -> int:
    out_dir, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optim = build()
    state = {"model": model, "optim": optim, "own": {"rank": rank, "position": 100 * rank}}
    replicas = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    ck = incluster.Checkpointer(job="dpshare", replicas=replicas, slot_timeout_s=60)
    res: dict = {}
    try:
        if phase == "save":
            g = torch.Generator().manual_seed(7)
            for _ in range(2):
                model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
                optim.step()
                optim.zero_grad()
            ck.save(2, state).wait(120)
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, f"model-r{rank}.pt"))
        else:
            state["own"] = {"rank": -1, "position": -1}
            res["loaded"] = ck.load(state)
            res["own"] = state["own"]
            res["notes"] = ck.last_restore.notes if ck.last_restore else []
            res["source"] = ck.last_restore.source if ck.last_restore else None
            saved = torch.load(os.path.join(out_dir, f"model-r{rank}.pt"))
            res["equal"] = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
            res["optim_state"] = len(optim.state)
    finally:
        ck.close()
    with open(os.path.join(out_dir, f"result-{phase}-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
