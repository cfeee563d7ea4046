"""Every wait has a deadline: a writer that stops answering becomes an error, not a hang."""

from __future__ import annotations

import contextlib
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


@pytest.mark.multiproc
def test_a_stopped_writer_is_killed_and_replaced_within_seconds(local_dir, monkeypatch):
    """A writer that answers nothing (SIGSTOP here) was never found out: only a send it did
    not read for 3 x slot_timeout_s killed it, saves' small requests never filled the
    socket, so every save waited slot_timeout_s for it, for good. Its heartbeat's silence
    now has it killed and replaced."""
    import signal
    import time

    from incluster.writer import protocol

    monkeypatch.setattr(protocol, "STALL_S", 3.0)
    ck = incluster.Checkpointer(local_dir=local_dir, job="stopped", slot_timeout_s=120)
    state = {"w": torch.ones(1000)}
    try:
        ck.save(1, state).wait(60)
        pid = ck.writer_pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(incluster.WriterProcessDied, match="not even its heartbeat"):
                ck.save(2, state).wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # never left stopped, whatever happened
        assert time.monotonic() - t0 < 20
        deadline = time.monotonic() + 60
        while ck.writer_pid in (pid, None):
            assert time.monotonic() < deadline, "no new writer process was started"
            time.sleep(0.05)
        state["w"] += 1
        ck.save(3, state).wait(60)  # the next save lands, on the new writer
    finally:
        ck.close()
    target = {"w": torch.zeros(1000)}
    with incluster.Checkpointer(local_dir=local_dir, job="stopped", writer="thread") as again:
        assert again.load(target) == 3 and torch.equal(target["w"], torch.full((1000,), 2.0))
