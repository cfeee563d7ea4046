"""A live state unlike the saved one is refused, never silently converted, and a refusal
after bytes landed says the live state was partly overwritten."""

from __future__ import annotations

import pytest
import torch

import incluster
from incluster.errors import CheckpointError


def _save(local_dir, state, step=1):
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        ck.save(step, state).wait()


def _load(local_dir, state):
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        return ck.load(state)


def test_an_int64_checkpoint_is_not_wrapped_into_an_int32_tensor(local_dir):
    _save(local_dir, {"counts": torch.tensor([2**40 + 7, -(2**35), 3])})
    live = {"counts": torch.zeros(3, dtype=torch.int32)}
    with pytest.raises(CheckpointError, match=r"counts: the checkpoint holds torch.int64 values but the live tensor is torch.int32"):
        _load(local_dir, live)
    assert live["counts"].tolist() == [0, 0, 0]


def test_fp32_weights_are_not_rounded_into_a_bf16_model(local_dir):
    torch.manual_seed(0)
    _save(local_dir, {"model": torch.nn.Linear(64, 64)})
    live = torch.nn.Linear(64, 64).to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"float32 values but the live tensor is torch.bfloat16.*cast it after load"):
        _load(local_dir, {"model": live})


def test_a_module_with_other_keys_is_refused_saying_what_was_overwritten(local_dir):
    torch.manual_seed(0)
    _save(local_dir, {"model": torch.nn.Sequential(torch.nn.Linear(64, 64))})
    torch.manual_seed(1)
    live = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))  # one layer more
    before = live[0].weight.detach().clone()
    with pytest.raises(CheckpointError) as err:
        _load(local_dir, {"model": live})
    assert "Missing key(s)" in str(err.value) and "1.weight" in str(err.value)
    if not torch.equal(live[0].weight, before):  # landed before load_state_dict refused: it must say so
        assert "partly overwritten" in str(err.value)


def test_a_failed_read_of_the_persistent_copy_is_the_tiers_failure_not_a_bad_copy(local_dir, tmp_path, monkeypatch):
    """Only the persistent tier holds step 2, and reading its shard fails (a connection
    reset, after the tier's own retries): load() raises TierUnavailableError, never sets
    the copy aside as bad (which ends in "every copy failed verification ... delete the
    persistent tier's folder") and never returns None (a fresh start over a good step)."""
    import shutil

    from incluster.tiers import persistent as P

    tier, ram = str(tmp_path / "tier"), f"{local_dir}/ram"
    want = torch.arange(1000, dtype=torch.float32)
    with incluster.Checkpointer(job="flaky", local_dir=ram, writer="thread", persistent=tier) as ck:
        h = ck.save(2, {"w": want.clone()})
        h.wait(60)
        assert h.persisted.result(60)
    shutil.rmtree(ram)  # the node's RAM is lost
    read = P.FsspecTier.read

    def reset(self, path, into=None):
        if path.endswith(".safetensors"):
            raise ConnectionResetError(104, "Connection reset by peer")
        return read(self, path, into)

    monkeypatch.setattr(P.FsspecTier, "read", reset)
    state = {"w": torch.zeros(1000)}
    with incluster.Checkpointer(job="flaky", local_dir=ram, writer="thread", persistent=tier) as ck:
        with pytest.raises(incluster.TierUnavailableError, match="reading it from the persistent tier failed"):
            ck.load(state)
    monkeypatch.setattr(P.FsspecTier, "read", read)  # the tier answers again: the step is still there
    with incluster.Checkpointer(job="flaky", local_dir=ram, writer="thread", persistent=tier) as ck:
        assert ck.load(state) == 2 and torch.equal(state["w"], want)
