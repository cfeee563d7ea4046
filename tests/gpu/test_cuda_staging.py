"""The CUDA staging path: pinned slot mapping, side-stream copies, event-ordered step.

Runs only where CUDA is available (marker ``gpu``); CPU-only runs skip it.
"""

from __future__ import annotations

import pytest
import torch

import incluster

pytestmark = pytest.mark.gpu


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    m(torch.randn(64, 1024, device="cuda")).pow(2).mean().backward()
    o.step()
    o.zero_grad()


def test_gpu_save_is_pinned_ordered_and_bitwise(local_dir):
    m, o = _model()
    _step(m, o)
    with incluster.Checkpointer(local_dir=local_dir, job="gpu") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        expected = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
        h = ck.save(2, {"model": m, "optim": o})
        assert h.blocked_s is not None and h.blocked_s < 0.5
        # The next step runs at once; the hook orders it after the copies on the GPU.
        _step(m, o)
        h.wait()
        slot = next(s for s in ck.ring.slots if s.step == 2)
        assert slot.pinned, "slot mapping should be registered as page-locked memory"
        torch.cuda.synchronize()
    m2, o2 = _model()
    with incluster.Checkpointer(local_dir=local_dir, job="gpu") as ck:
        assert ck.load({"model": m2, "optim": o2}) == 2
    for k, v in m2.state_dict().items():
        assert v.is_cuda
        assert torch.equal(v.cpu(), expected[k]), k


def test_copies_overlap_and_values_are_from_save_time(local_dir):
    """Many saves while training continues: each step's shard holds that step's values."""
    m, o = _model()
    with incluster.Checkpointer(local_dir=local_dir, job="gpu2", keep=3) as ck:
        for step in range(1, 6):
            _step(m, o)
            snap = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
            ck.save(step, {"model": m, "optim": o})
            _step(m, o)  # mutates right after save() returns
            ck.wait()
            from incluster.tiers.local import ShardReader

            with ShardReader(ck.folder, step) as r:
                for k, v in snap.items():
                    assert torch.equal(r.tensor(f"model/{k}"), v), (step, k)
