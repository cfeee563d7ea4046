"""load(state, step=N): that step and no other - a rollback - from the RAM disk or the
persistent tier; a step that cannot be restored is refused before any byte lands, and the
saves after a rollback are the timeline later restores take."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

import incluster


def _ckpt(local_dir, **kw):
    return incluster.Checkpointer(local_dir=local_dir, job="roll", writer="thread", **{"keep": 4, **kw})


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


def test_a_named_step_whose_only_copy_is_corrupt_is_refused_before_any_byte_lands(local_dir):
    # With no older step to overwrite them, a bad copy's bytes landed in the live state and
    # the error said both "nothing is loaded" and "partly overwritten".
    _saved(local_dir, [10, 20])
    shard = glob.glob(os.path.join(local_dir, "roll", "rank-00000", "step-000000000020.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 64)  # in the tensor's bytes: the first chunk, which lands first
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    state = _fresh()
    with _ckpt(local_dir) as ck:
        with pytest.raises(incluster.NoCheckpointError, match=r"load\(step=20\).*failed verification") as got:
            ck.load(state, step=20)
        assert "overwritten" not in str(got.value)
        assert torch.equal(state["w"], torch.full((64,), -1.0)) and state["extra"]["step"] == -2  # untouched
        assert ck.load(state, step=10) == 10 and torch.equal(state["w"], torch.full((64,), 10.0))


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


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 8)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_refused_rollback_leaves_the_newer_steps_and_the_history_as_they_were(local_dir, tmp_path):
    """The step is only in the tier, its copy there bad, every slot holding a newer step:
    the rollback fails; the newer steps stay loadable (but the one whose slot the download
    took), and a save after the refusal goes on from the live state's timeline (the older
    steps can still be rolled back to)."""
    tier = str(tmp_path / "tier")
    state = {"w": torch.zeros(64), "extra": {"step": -1}}
    with _ckpt(local_dir, persistent=tier, persistent_every=1000, keep=2) as ck:
        for step in (10, 20, 30, 40, 50, 60):
            state["w"].fill_(float(step))
            h = ck.save(step, state, persist=True if step in (10, 30, 50) else None)
            h.wait()
            h.persisted.result(30)
    _flip(glob.glob(f"{tier}/roll/step-*30/rank-00000.safetensors")[0])
    held = sorted(n for n in os.listdir(f"{local_dir}/roll/rank-00000") if n.endswith(".json"))
    assert held == [f"step-{s:012d}.json" for s in (40, 50, 60)], held  # every slot (keep=2, +1: a tier)
    state = _fresh()
    with _ckpt(local_dir, persistent=tier, keep=2) as ck:
        with pytest.raises(incluster.NoCheckpointError, match=r"load\(step=30\).*set aside \(.*checksum mismatch"):
            ck.load(state, step=30)
        assert torch.equal(state["w"], torch.full((64,), -1.0))
        assert ck.load(state) == 60
        with pytest.raises(incluster.NoCheckpointError, match="step 55"):
            ck.load(state, step=55)
        state["w"].fill_(70.0)
        ck.save(70, state).wait()
    with _ckpt(local_dir, persistent=tier, keep=2) as ck:
        assert ck.load(state, step=50) == 50 and torch.equal(state["w"], torch.full((64,), 50.0))


def test_the_tier_steps_a_rollback_left_are_never_restored(local_dir, tmp_path, caplog):
    """Rolled back to 10, then the cluster's RAM lost before any save of the new timeline
    reached the tier: the restore takes 10, not the abandoned 30; and the next upload does
    not warn of the steps the rollback set aside on purpose."""
    tier = str(tmp_path / "tier")
    state = {"w": torch.zeros(64), "extra": {"step": -1}}
    with _ckpt(local_dir, persistent=tier, persistent_keep=4) as ck:
        for step in (10, 20, 30):
            state["w"].fill_(float(step))
            assert ck.save(step, state, persist=True).persisted.result(30) is True
        assert ck.load(state, step=10) == 10
        with caplog.at_level("WARNING", logger="incluster"):
            assert ck.save(11, state, persist=True).persisted.result(30) is True
        assert not [r for r in caplog.records if "newer than this run's step" in r.getMessage()]
    shutil.rmtree(local_dir + "/roll")
    shutil.rmtree(tier + "/roll/step-000000000011")  # as if the RAM was lost before that upload
    state = _fresh()
    with _ckpt(local_dir, persistent=tier) as ck:
        with pytest.raises(incluster.NoCheckpointError, match=r"set aside \(abandoned by load\(step=10\)"):
            ck.load(state, step=30)
        assert ck.load(state) == 10 and ck.last_restore.source == "persistent"
        assert torch.equal(state["w"], torch.full((64,), 10.0))


def test_a_ring_frees_committed_slots_whose_record_is_gone(local_dir):
    with _ckpt(local_dir) as ck:
        for step in (2, 4, 6):
            ck.save(step, {"w": torch.full((64,), float(step))}).wait()
        os.unlink(glob.glob(f"{ck.folder}/step-*4.json")[0])  # un-committed on disk (abandon_newer)
        ck.ring.forget_unmarked()
        assert ck.ring.committed_steps() == [2, 6]
