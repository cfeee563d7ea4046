"""load(state, step=N): that step and no other - a rollback - from the RAM disk or the
persistent tier; a step that cannot be restored is refused before any byte lands, and the
saves after a rollback are the timeline later restores take."""

from __future__ import annotations

import shutil

import pytest
import torch

import incluster


def _ckpt(local_dir, **kw):
    return incluster.Checkpointer(local_dir=local_dir, job="roll", writer="thread", keep=4, **kw)


def _saved(local_dir, steps, **kw):
    state = {"w": torch.zeros(64), "extra": {"step": -1}}
    with _ckpt(local_dir, **kw) as ck:
        for step in steps:
            state["w"].fill_(float(step))
            state["extra"]["step"] = step
            ck.save(step, state).wait()


def _fresh():
    return {"w": torch.full((64,), -1.0), "extra": {"step": -2}}


def test_a_named_step_is_restored_and_the_saves_after_it_are_the_new_timeline(local_dir):
    _saved(local_dir, [10, 20, 30, 40])
    state = _fresh()
    with _ckpt(local_dir) as ck:
        assert ck.load(state, step=20) == 20
        assert torch.equal(state["w"], torch.full((64,), 20.0)) and state["extra"]["step"] == 20
        state["w"].fill_(21.0)
        ck.save(21, state).wait()  # 30 and 40 are newer, but this timeline goes on from 20
    state = _fresh()
    with _ckpt(local_dir) as ck:
        assert ck.load(state) == 21 and torch.equal(state["w"], torch.full((64,), 21.0))


def test_a_step_that_cannot_be_restored_is_refused_before_any_byte_lands(local_dir):
    _saved(local_dir, [10, 20])
    state = _fresh()
    with _ckpt(local_dir) as ck:
        with pytest.raises(incluster.NoCheckpointError, match=r"load\(step=15\): no good copy .* of step 15"):
            ck.load(state, step=15)
        assert torch.equal(state["w"], torch.full((64,), -1.0)) and state["extra"]["step"] == -2
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            ck.load(state, step=-1)
        assert ck.load(state) == 20  # a plain load still finds the newest


def test_a_named_step_only_the_persistent_tier_holds_comes_from_there(local_dir, tmp_path):
    tier = str(tmp_path / "tier")
    _saved(local_dir, [10, 20, 30], persistent=tier, persistent_every=100)  # the tier gets the first save only
    shutil.rmtree(local_dir + "/roll")  # every node's RAM lost
    state = _fresh()
    with _ckpt(local_dir, persistent=tier) as ck:
        with pytest.raises(incluster.NoCheckpointError, match=r"step 20 is in the cluster's RAM or the persistent tier"):
            ck.load(state, step=20)
        assert ck.load(state, step=10) == 10
        assert ck.last_restore is not None and ck.last_restore.source == "persistent"
        assert torch.equal(state["w"], torch.full((64,), 10.0))
