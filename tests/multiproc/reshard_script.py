"""An FSDP2 job saved by one world size and restored by another (gloo, CPU).

    python reshard_script.py OUT_DIR PHASE     (PHASE: save or load; replicas=1)

``save``: train 3 steps, save step 3 (durable, replicated), write the full state (every
DTensor gathered) to OUT_DIR/full-save.pt. ``load``: build the same model at this world
size, load, write the full state to OUT_DIR/full-load.pt, then train one step and save
step 4 (training goes on at the new size). Each rank writes OUT_DIR/result-PHASE-rR.json.
With RESHARD_PERSISTENT=DIR every save also goes to that persistent folder;
RESHARD_MESH_SAVE / RESHARD_MESH_LOAD="2,2" make that phase HSDP on a 2 x 2 mesh;
RESHARD_RULE sets reshard_rank_state; WIRE_PIECE=N moves the pieces through the staged
wire NCCL uses, with CPU buffers of N bytes (the result records the most any move held);
WRITER=thread|process picks the writer (default process).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import incluster


def build(world: int, mesh_shape: tuple[int, ...]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 over a 1-D mesh, or HSDP over a (replicate, shard) mesh."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5)
    )
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every value gathered whole (a collective: every rank calls it)."""
    out = {f"model/{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for pid, s in optim.state_dict()["state"].items():
        for k, v in s.items():
            out[f"optim/{pid}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def main() -> int:
    out_dir, phase = sys.argv[1], sys.argv[2]
    wire_peak = None
    if os.environ.get("WIRE_PIECE"):
        from incluster.testing.wire import route_through_staged_wire

        wire_peak = route_through_staged_wire(int(os.environ["WIRE_PIECE"]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = os.environ.get(f"RESHARD_MESH_{phase.upper()}")  # e.g. "2,2": HSDP
    model, optim = build(world, tuple(int(x) for x in mesh.split(",")) if mesh else (world,))
    state = {"model": model, "optim": optim, "loader": {"position": 1000 + rank}}
    tier = os.environ.get("RESHARD_PERSISTENT")  # a folder: every save also goes there
    rule = os.environ.get("RESHARD_RULE", "same-rank")
    ck = incluster.Checkpointer(job="reshard", replicas=1, slot_timeout_s=60, persistent=tier, persistent_every=1,
                                reshard_rank_state=rule, writer=os.environ.get("WRITER", "process"))
    ck._refuse_resize = os.environ.get("RESHARD_REFUSE")  # as the Lightning and accelerate integrations set it
    res: dict = {"world": world}
    try:
        if phase == "save":
            train(model, optim, 3, rank, seed=1)
            handle = ck.save(3, state)
            handle.wait(120)
            if tier:
                handle.persisted.result(120)
            full = full_state(model, optim)
            name = "full-save.pt"
        else:
            res["loaded"] = ck.load(state)
            rep = ck.last_restore
            res["source"] = rep.source if rep else None
            res["notes"] = rep.notes if rep else []
            res["line"] = rep.line() if rep else ""
            res["position"] = state["loader"]["position"]
            res["wire_peak"] = wire_peak[0] if wire_peak else None
            full = full_state(model, optim)
            name = "full-load.pt"
            train(model, optim, 1, rank, seed=2)
            ck.save(4, state).wait(120)
            res["step4"] = "durable"
        if rank == 0:
            torch.save(full, os.path.join(out_dir, name))
    finally:
        ck.close()
    with open(os.path.join(out_dir, f"result-{phase}-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
