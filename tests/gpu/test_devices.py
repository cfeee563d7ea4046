"""A state on a GPU other than the current device, and a state over two GPUs: the save's
copies are ordered before each GPU's optimizer step, and a restore lands on each GPU
bitwise. Needs two or more GPUs (skipped otherwise, and without CUDA)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import incluster

from test_cuda_staging import DELAY, _assert_shard, _expected, delayed_copies  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _model(devices: list[str], seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(1024, 1024).to(devices[i % len(devices)]) for i in range(4)]
    return torch.nn.Sequential(*layers), torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-3)


def _step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    x = torch.randn(64, 1024, device=next(m.parameters()).device)
    for layer in m:
        x = layer(x.to(layer.weight.device))
    x.pow(2).mean().backward()
    o.step()
    o.zero_grad()


@pytest.mark.parametrize("gpu_snapshot", [None, 0], ids=["snapshot", "direct"])
def test_a_state_on_cuda_1_with_the_current_device_0_is_ordered(local_dir, delayed_copies, gpu_snapshot):  # noqa: F811
    assert torch.cuda.current_device() == 0
    m, o = _model(["cuda:1"])
    with incluster.Checkpointer(local_dir=local_dir, job="dev1", replicas=0, gpu_snapshot=gpu_snapshot) as ck:
        _step(m, o)
        state = {"model": m, "optim": o}
        ck.save(1, state).wait()
        _step(m, o)
        expected = _expected(state)
        h = ck.save(2, state)
        _step(m, o)  # cuda:1's stream must wait for the copies, not cuda:0's
        h.wait()
        assert ck.gpu_snapshot_active is (gpu_snapshot is None)
        _assert_shard(ck.folder, 2, expected)


def test_a_state_over_two_gpus_is_ordered_and_restored_bitwise(local_dir, delayed_copies):  # noqa: F811
    m, o = _model(["cuda:0", "cuda:1"])
    state = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="two", replicas=0) as ck:
        _step(m, o)
        ck.save(1, state).wait()
        _step(m, o)
        expected = _expected(state)
        h = ck.save(2, state)
        _step(m, o)
        h.wait()
        _assert_shard(ck.folder, 2, expected)
    m2, o2 = _model(["cuda:0", "cuda:1"], seed=3)
    _step(m2, o2)
    with incluster.Checkpointer(local_dir=local_dir, job="two", replicas=0) as ck:
        assert ck.load({"model": m2, "optim": o2}) == 2
    got = _expected({"model": m2, "optim": o2})
    assert {k: torch.equal(got[k], v) for k, v in expected.items()} == {k: True for k in expected}


_ON_CUDA_1_ONLY = """
import sys, torch, incluster
m = torch.nn.Linear(1024, 1024).to("cuda:1"); o = torch.optim.AdamW(m.parameters())
m(torch.randn(8, 1024, device="cuda:1")).sum().backward(); o.step()
with incluster.Checkpointer(local_dir=sys.argv[1], job="ctx", replicas=0) as ck:
    ck.prepare({"m": m, "o": o}).result(120)
    for step in (1, 2):
        ck.save(step, {"m": m, "o": o}).wait(120)
        o.step()
with incluster.Checkpointer(local_dir=sys.argv[1], job="ctx", replicas=0) as ck:
    assert ck.load({"m": m, "o": o}) == 2
print("context on GPU 0:", torch._C._cuda_hasPrimaryContext(0))
"""


def test_a_state_on_cuda_1_makes_no_context_on_gpu_0(local_dir):
    """Each rank of a multi-GPU node on its own GPU: nothing of the save, its threads or
    the restore makes a CUDA context (~0.5 GiB) on GPU 0."""
    out = subprocess.run([sys.executable, "-c", _ON_CUDA_1_ONLY, local_dir], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "context on GPU 0: False" in out.stdout, out.stdout[-2000:]
