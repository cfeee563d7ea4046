"""What save() raises is a CheckpointError a training loop can catch, and a failed save
says so."""

from __future__ import annotations

import os

import pytest
import torch

import incluster
from incluster.staging.slots import SlotRing


def test_a_ram_folder_that_cannot_be_written_is_a_checkpoint_error_and_the_next_save_lands(local_dir, monkeypatch):
    """A read-only RAM folder made save() raise a raw PermissionError (from recycling a
    slot), which the README's try/except CheckpointError let through: it ended the job."""
    state = {"w": torch.arange(64.0)}
    with incluster.Checkpointer(local_dir=local_dir, job="perm", writer="thread", keep=2) as ck:
        for step in (0, 1):
            ck.save(step, state).wait()

        def refused(self, slot):
            raise PermissionError(13, "Permission denied", f"{self.folder}/step-000000000000.json")

        monkeypatch.setattr(SlotRing, "_uncommit", refused)
        with pytest.raises(incluster.TierUnavailableError, match=r"save\(2\) cannot use this node's RAM folder .*"
                           r"Permission denied.*fix its permissions"):
            ck.save(2, state)
        monkeypatch.undo()
        h = ck.save(3, state)
        h.wait()
        assert repr(h) == "SaveHandle(step=3, durable)"
    with incluster.Checkpointer(local_dir=local_dir, job="perm", writer="thread") as ck:
        assert ck.load({"w": torch.zeros(64)}) == 3


def test_a_failed_save_does_not_print_as_durable(local_dir, monkeypatch):
    from incluster.testing import FaultInjector

    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="commit", step=1).env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="failed", writer="thread") as ck:
        h = ck.save(1, {"w": torch.ones(2)})
        with pytest.raises(incluster.CheckpointError):
            h.wait()
        assert repr(h).startswith("SaveHandle(step=1, failed: "), repr(h)


@pytest.mark.parametrize("where", ["plain", "module", "nested"])
def test_a_complex_tensor_is_refused_by_save_itself_and_the_next_save_lands(local_dir, where):
    """It was refused on the staging thread: the error then came out of the next, valid
    save() (which did not save its step) or out of close()."""
    z = torch.zeros(2, dtype=torch.complex64)
    model = torch.nn.Linear(2, 2)
    if where == "module":
        model.register_buffer("phase", z)
    bad = {"model": model, "z": z} if where == "plain" else {"model": model} if where == "module" else {"a": [{"z": z}]}
    with incluster.Checkpointer(local_dir=local_dir, job="cplx2", writer="thread") as ck:
        with pytest.raises(incluster.CheckpointError, match="complex64.*view_as_real"):
            ck.save(1, bad)
        ck.save(2, {"w": torch.ones(2)}).wait()


def test_a_ram_folder_removed_under_the_running_job_is_named_with_the_cause_and_fix(local_dir):
    # (systemd-logind's RemoveIPC at logout, a cleanup job): every commit failed on a
    # vanished staging file, naming only the file
    import shutil

    import incluster

    with incluster.Checkpointer(local_dir=local_dir, job="gone", writer="thread") as ck:
        ck.save(1, {"w": torch.ones(64)}).wait()
        shutil.rmtree(os.path.join(local_dir, "gone"))
        with pytest.raises(incluster.TierUnavailableError, match=r"RAM folder .* was removed while the job ran.*Restart"):
            ck.save(2, {"w": torch.ones(64)})
