"""One rank of a ``bench/recovery_reshard.py`` job: the FSDP2 model, its pattern, the
saves and the timed restores.

Launched by the driver (``bench/recovery_reshard.py --_worker CFG``) through
``incluster.testing.launch``; each rank writes its results as JSON for the driver.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from typing import Any

import torch

JOB, STEP = "bench-reshard", 1
MUL, MASK, CHUNK = 2654435761, (1 << 30) - 1, 1 << 23


def build(world: int, hidden: int, layers: int, optim: bool) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    opt = None
    if optim:  # one step on zero gradients creates the moments (DTensors); overwritten below
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def dtensors(model: Any, opt: Any) -> list[tuple[str, Any]]:
    out = [(f"model/{n}", p) for n, p in model.named_parameters()]
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            out += [(f"optim/{names[id(p)]}/{k}", st[k]) for k in ("exp_avg", "exp_avg_sq")]
    return out


def pattern(lo: int, n: int, seed: int) -> torch.Tensor:
    """int32 bits at flat global indexes lo..lo+n (< 2**30 each: finite floats, |x| < 2)."""
    return ((torch.arange(lo, lo + n, dtype=torch.int64) * MUL + seed * 0x9E3779B1) & MASK).to(torch.int32)


def _local(dt: Any) -> tuple[torch.Tensor, int]:
    """This rank's local tensor (int32 view) and the flat global index of its first element
    (a Shard(0) piece of a row-major tensor is one contiguous range)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = dt.to_local()
    _, off = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    assert local.is_contiguous() and all(o == 0 for o in off[1:])
    return local.view(torch.int32).view(-1), off[0] * math.prod(dt.shape[1:])


@torch.no_grad()
def fill(tensors: list[tuple[str, Any]], zero: bool = False) -> None:
    for i, (_, dt) in enumerate(tensors):
        flat, lo = _local(dt)
        for a in range(0, flat.numel(), CHUNK):
            n = min(CHUNK, flat.numel() - a)
            flat[a : a + n] = 0 if zero else pattern(lo + a, n, i)


@torch.no_grad()
def check(tensors: list[tuple[str, Any]]) -> list[str]:
    """Names of the tensors whose local piece differs from the pattern anywhere."""
    bad = []
    for i, (name, dt) in enumerate(tensors):
        flat, lo = _local(dt)
        if not all(torch.equal(flat[a : a + CHUNK], pattern(lo + a, min(CHUNK, flat.numel() - a), i))
                   for a in range(0, flat.numel(), CHUNK)):
            bad.append(name)
    return bad


def dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    if opt is None:
        return {"model": model.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def dcp_load(path: str, model: Any, opt: Any) -> None:
    import torch.distributed.checkpoint as dcp

    sd = dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    if opt is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(cfg: dict[str, Any]) -> int:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import incluster

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg["threads"])
    out: dict[str, Any] = {"rank": rank, "world": world}
    try:
        model, opt = build(world, cfg["hidden"], cfg["layers"], cfg["optim"])
        state = {"model": model} if opt is None else {"model": model, "optim": opt}
        opts = {"job": JOB, "writer": cfg["writer"], "replicas": 1, "slot_timeout_s": cfg["timeout_s"]}
        if cfg["phase"] == "save":
            fill(dtensors(model, opt))
            out["bad_before_save"] = check(dtensors(model, opt))
            out["local_bytes"] = sum(dt.to_local().nbytes for _, dt in dtensors(model, opt))
            ckpt = incluster.Checkpointer(**opts)
            out["save_s"] = timed(lambda: ckpt.save(STEP, state).wait(cfg["timeout_s"]))
            ckpt.close()
            dist.barrier()
            if rank == 0:
                out["free_slots_removed_bytes"] = remove_free_slots(cfg["base"])
            dist.barrier()
            out["dcp_save_s"] = timed(lambda: dcp.save(dcp_state(model, opt), checkpoint_id=cfg["dcp_dir"]))
        else:
            out["local_bytes"] = sum(dt.to_local().nbytes for _, dt in dtensors(model, opt))
            out["incluster"], out["dcp"] = [], []
            for _ in range(cfg["repeats"]):
                fill(dtensors(model, opt), zero=True)
                t0 = time.perf_counter()
                ckpt = incluster.Checkpointer(**opts)
                ctor = time.perf_counter() - t0
                box: list[Any] = []
                wall = timed(lambda: box.append(ckpt.load(state)))
                rep = ckpt.last_restore
                assert rep is not None
                out["incluster"].append({"wall_s": wall, "report_s": rep.seconds, "ctor_s": ctor, "step": box[0],
                                         "source": rep.source, "bytes": rep.bytes, "notes": rep.notes,
                                         "bad": check(dtensors(model, opt))})
                ckpt.close()
                fill(dtensors(model, opt), zero=True)
                wall = timed(lambda: dcp_load(cfg["dcp_dir"], model, opt))
                out["dcp"].append({"wall_s": wall, "bad": check(dtensors(model, opt))})
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    with open(os.path.join(cfg["results"], f"{cfg['phase']}-r{rank}.json"), "w") as f:
        json.dump(out, f)
    if "error" not in out:
        dist.destroy_process_group()
    return 1 if "error" in out else 0


def remove_free_slots(base: str) -> int:
    """Unlink ``.staging-*`` slot files (free slots, never read by a restore), so the run fits."""
    freed = 0
    for root, _dirs, files in os.walk(base):
        for n in files:
            if n.startswith(".staging-"):
                freed += os.path.getsize(os.path.join(root, n))
                os.unlink(os.path.join(root, n))
    return freed
