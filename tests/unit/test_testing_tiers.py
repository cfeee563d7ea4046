"""FaultyTier and SlowTier, as a user would use them: a store that refuses, comes back,
or is slow, behind a real Checkpointer. Training never stops for the persistent tier."""

from __future__ import annotations

import logging
import os
import pickle

import pytest
import torch

import incluster
from incluster.testing import FaultyTier, SlowTier
from incluster.tiers.base import Tier
from incluster.tiers.persistent import FsspecTier


def _state(v: float) -> dict:
    return {"w": torch.full((4096,), v), "extra": {"v": v}}


def _manifested(root: str) -> list[str]:
    base = os.path.join(root, "t")
    if not os.path.isdir(base):
        return []
    return sorted(n for n in os.listdir(base) if os.path.exists(os.path.join(base, n, "COMMITTED.json")))


def test_wrappers_are_tiers_and_pickle(tmp_path):
    inner = FsspecTier(str(tmp_path / "p"))
    for t in (FaultyTier(inner, ops=("write",), times=1), SlowTier(inner, latency_s=0.01)):
        assert isinstance(t, Tier)
        assert isinstance(pickle.loads(pickle.dumps(t)), type(t))
    with pytest.raises(ValueError, match="ops must be among"):
        FaultyTier(inner, ops=("upload",))
    with pytest.raises(ValueError, match="bytes_per_s"):
        SlowTier(inner, bytes_per_s=0)


def test_faulty_tier_fails_only_what_it_is_told(tmp_path):
    t = FaultyTier(FsspecTier(str(tmp_path / "p")), ops=("write",), after=1, times=2, paths=("shard",))
    t.write("a/shard-1", memoryview(b"1"))  # the first matching call passes
    t.write("a/other", memoryview(b"x"))  # not a matching path
    for _ in range(2):
        with pytest.raises(OSError, match="refused write"):
            t.write("a/shard-2", memoryview(b"2"))
    t.write("a/shard-2", memoryview(b"2"))  # the store is back
    assert t.list("a") == ["other", "shard-1", "shard-2"] and t.failures == 2


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_store_that_refuses_twice_is_retried_and_the_step_lands(local_dir, tmp_path, writer, caplog):
    root = str(tmp_path / "p")
    flaky = FaultyTier(FsspecTier(root), ops=("write",), times=2)
    caplog.set_level(logging.INFO, logger="incluster")
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer=writer, persistent=flaky, persistent_every=1) as ck:
        h = ck.save(1, _state(1.0))
        assert h.persisted.result(60) is True
    assert _manifested(root) == ["step-000000000001"]
    if writer == "thread":
        assert "retry 1" in caplog.text and "retry 2" in caplog.text


def test_an_unreachable_store_is_reported_training_goes_on_and_ram_restores(local_dir, tmp_path, caplog):
    root = str(tmp_path / "p")
    down = FaultyTier(FsspecTier(root))
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread", persistent=down, persistent_every=1) as ck:
        h1 = ck.save(1, _state(1.0))
        h1.wait()  # committed in RAM whatever the store does
        with pytest.raises(incluster.TierUnavailableError, match="step 1 did not reach the persistent tier.*refused"):
            h1.persisted.result(60)
        h2 = ck.save(2, _state(2.0))
        h2.wait()
    assert _manifested(root) == []
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread", persistent=down) as ck:
        assert ck.load(target) == 2  # the store is still down: the RAM tier serves the restore
    assert torch.equal(target["w"], torch.full((4096,), 2.0))
    assert "cannot be listed" in caplog.text


def test_a_slow_store_makes_a_due_save_skip_not_wait(local_dir, tmp_path):
    root = str(tmp_path / "p")
    slow = SlowTier(FsspecTier(root), latency_s=0.5)
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread", persistent=slow, persistent_every=1) as ck:
        first = ck.save(0, _state(0.0))
        first.wait()
        second = ck.save(1, _state(1.0))  # due while step 0 still uploads
        second.wait()
        assert second.persisted.result(60) is False
        assert first.persisted.result(60) is True
        assert _manifested(root) == ["step-000000000000"]
    assert _manifested(root) == ["step-000000000000", "step-000000000001"]  # close() caught the tier up


def test_an_unpicklable_tier_with_a_writer_process_names_the_fix(local_dir):
    class Local(FaultyTier):
        pass  # defined in a function: pickle cannot find it by name

    with pytest.raises(ValueError, match="must be picklable.*writer='thread'"):
        incluster.Checkpointer(local_dir=local_dir, job="t", persistent=Local(FsspecTier("/tmp/never")))
