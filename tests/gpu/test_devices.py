"""A state on a GPU other than the current device, and a state over two GPUs: the save's
copies are ordered before each GPU's optimizer step, and a restore lands on each GPU
bitwise. Needs two or more GPUs (skipped otherwise, and without CUDA)."""

from __future__ import annotations

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
