"""Small builders shared by tests (not fixtures: plain functions)."""

from __future__ import annotations

import os
from typing import Any

import torch

from incluster.format.checksum import compute
from incluster.format.dtypes import dtype_name
from incluster.format.layout import TensorSpec, build_layout
from incluster.format.sidecar import Sidecar, write_sidecar
from incluster.staging.engine import make_views
from incluster.staging.slots import sidecar_file, step_file


def tiny_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, model[0].in_features, generator=g)
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def clone_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of model and optimizer state, to compare against bit for bit."""
    osd = optim.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim_state": {
            pid: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for pid, s in osd["state"].items()
        },
        "param_groups": [dict(g) for g in osd["param_groups"]],
    }


def assert_bitwise(model: torch.nn.Module, optim: torch.optim.Optimizer, ref: dict[str, Any]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref["model"][k]), f"model/{k} differs"
        assert v.dtype == ref["model"][k].dtype
    osd = optim.state_dict()
    assert set(osd["state"]) == set(ref["optim_state"])
    for pid, s in ref["optim_state"].items():
        for k, v in s.items():
            got = osd["state"][pid][k]
            assert torch.equal(got, v) if torch.is_tensor(v) else got == v, f"optim state {pid}/{k} differs"
    assert osd["param_groups"] == ref["param_groups"]


def flip_byte(path: str, at: int | None = None) -> None:
    """Flip one bit of the byte at offset ``at`` (default: the middle) of a file."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if at is None else at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def shard_bytes(tensors: dict[str, torch.Tensor]) -> tuple[bytes, Any]:
    """A shard file's bytes for ``tensors`` (header and data, as the writer lays them out),
    and their flattened state."""
    from incluster.state import flatten

    flat = flatten(tensors)
    layout = build_layout(flat.specs)
    body = bytearray(layout.total_size)
    body[: layout.data_start] = layout.header
    for e, t in zip(layout.entries, flat.tensors):
        body[e.offset : e.offset + e.nbytes] = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return bytes(body), flat


def write_shard(folder: str, *, job: str, step: int, rank: int, world: int, node: str,
                tensors: dict[str, torch.Tensor], tree: Any, extra: dict[str, Any] | None = None) -> None:
    """One committed shard, written the way writer/local_commit.py writes a slot."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    layout = build_layout([TensorSpec(n, dtype_name(t.dtype, n), tuple(t.shape)) for n, t in tensors.items()])
    buf = torch.zeros(layout.total_size, dtype=torch.uint8)
    buf[: len(layout.header)] = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
    for view, t in zip(make_views(buf, layout), tensors.values()):
        view.copy_(t)
    data = buf.numpy().tobytes()
    with open(os.path.join(folder, step_file(step)), "wb") as f:
        f.write(data)
    sc = Sidecar(job=job, step=step, rank=rank, world_size=world, node=node, shard=step_file(step),
                 checksum=compute(data), fingerprint=layout.fingerprint, tree=tree, extra=extra or {})
    write_sidecar(os.path.join(folder, sidecar_file(step)), sc)
