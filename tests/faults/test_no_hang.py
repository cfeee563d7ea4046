"""Every wait has a deadline: a writer that stops answering becomes an error, not a hang."""

from __future__ import annotations

import os

import pytest
import torch

import incluster
from incluster.testing import FaultInjector


@pytest.mark.multiproc
def test_a_writer_that_stops_answering_is_a_timeout_and_close_returns(local_dir, tmp_path, monkeypatch):
    fault = FaultInjector().fail_at(phase="commit", step=2, action="hang", marker_dir=str(tmp_path))
    monkeypatch.setenv(*next(iter(fault.env().items())))
    ck = incluster.Checkpointer(local_dir=local_dir, job="hang", slot_timeout_s=2)
    state = {"w": torch.ones(1000)}
    ck.save(1, state).wait()
    with pytest.raises(incluster.PeerTimeoutError, match="step 2 is not durable 6 s after save"):
        ck.save(2, state).wait()
    assert os.path.exists(tmp_path / "fault-commit-r0-s2")  # it really hung there
    pid = ck.writer_pid
    ck.close()  # bounded: the silent writer is killed
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"
    monkeypatch.delenv("INCLUSTER_FAULTS")
    target = {"w": torch.zeros(1000)}
    with incluster.Checkpointer(local_dir=local_dir, job="hang", writer="thread") as again:
        assert again.load(target) == 1  # the step before the silent writer is intact
    assert torch.equal(target["w"], torch.ones(1000))
