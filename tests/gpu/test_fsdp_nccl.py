"""FSDP2 on one GPU under NCCL, as a sharded job's rank saves it: the DTensor shards go
through the device-side snapshot (or direct copies), the optimizer step right after the
save is ordered after the copies (they are delayed on the GPU), and a restore into a
fresh FSDP2 model and optimizer is bitwise.

Runs only where CUDA is available (marker ``gpu``); CPU-only runs skip it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import incluster

from test_cuda_staging import delayed_copies  # noqa: F401 - a fixture

pytestmark = pytest.mark.gpu


def _fsdp(device: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, device: str) -> None:
    model(torch.randn(32, 512, device=device)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _local(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's and optimizer state's local shard, on the host."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.to_local().detach().cpu().clone()
        for k, v in optim.state[p].items():
            v = v.to_local() if hasattr(v, "to_local") else v
            out[f"{name}.{k}"] = v.detach().cpu().clone()
    return out


def fsdp_round_trip(root: str, device: str, backend: str, gpu_snapshot: int | None) -> None:
    dist.init_process_group(backend, store=dist.FileStore(os.path.join(root, "pg"), 1), rank=0, world_size=1,
                            **({"device_id": torch.device(device)} if backend == "nccl" else {}))
    try:
        model, optim = _fsdp(device, 0)
        state = {"model": model, "optim": optim}
        with incluster.Checkpointer(local_dir=root, job="fsdp", replicas=0, gpu_snapshot=gpu_snapshot) as ck:
            _step(model, optim, device)
            ck.save(1, state).wait(120)
            _step(model, optim, device)
            if device != "cpu":
                torch.cuda.synchronize()
            expected = _local(model, optim)
            h = ck.save(2, state)
            _step(model, optim, device)  # no synchronization: the pre-step hook orders it on the GPU
            h.wait(120)
        model2, optim2 = _fsdp(device, 7)
        _step(model2, optim2, device)
        with incluster.Checkpointer(local_dir=root, job="fsdp", replicas=0) as ck:
            assert ck.load({"model": model2, "optim": optim2}) == 2
        got = _local(model2, optim2)
        assert set(got) == set(expected)
        differ = [k for k, v in expected.items() if not torch.equal(got[k], v)]
        assert not differ, f"{len(differ)} of {len(expected)} differ after the restore: {differ[:4]}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gpu_snapshot", [None, 0], ids=["snapshot", "direct"])
def test_fsdp2_under_nccl_saves_ordered_and_restores_bitwise(local_dir, delayed_copies, gpu_snapshot):  # noqa: F811
    fsdp_round_trip(local_dir, "cuda:0", "nccl", gpu_snapshot)
