"""A trainer SIGKILLed in the middle of a save: the previous step restores bitwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import incluster

CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    import incluster
    from incluster.testing import FaultInjector
    local_dir, marker_dir, phase = sys.argv[1:4]
    # The writer process hangs at the phase of step 2 (after the rename, before the
    # sidecar; or before the checksum); the test then SIGKILLs the trainer (the writer
    # dies with it).
    FaultInjector().fail_at(phase=phase, step=2, action="hang", marker_dir=marker_dir).install()
    torch.manual_seed(0)
    w = torch.randn(1 << 16)
    ck = incluster.Checkpointer(local_dir=local_dir, job="crash")
    ck.save(1, {"w": w, "extra": {"step": 1}}).wait()
    torch.save(w.clone(), os.path.join(local_dir, "expected.pt"))

    w.add_(1)
    ck.save(2, {"w": w, "extra": {"step": 2}})
    time.sleep(600)
    """
)


@pytest.mark.multiproc
@pytest.mark.parametrize("phase", ["sidecar", "commit"])
def test_sigkill_during_commit_keeps_previous_step(local_dir, phase):
    marker = os.path.join(local_dir, f"fault-{phase}-r0-s2")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, local_dir, local_dir, phase])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert proc.poll() is None, "child died early"
            assert time.monotonic() < deadline, "child never reached the commit"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        time.sleep(0.2)  # the writer follows its trainer (parent-death signal)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    expected = torch.load(os.path.join(local_dir, "expected.pt"))
    target = {"w": torch.zeros(1 << 16), "extra": {}}
    with incluster.Checkpointer(local_dir=local_dir, job="crash") as ck:
        assert ck.load(target) == 1
        assert torch.equal(target["w"], expected) and target["extra"] == {"step": 1}
        ck.save(2, {"w": target["w"] + 1, "extra": {"step": 2}}).wait()  # the torn slot is reused
        names = os.listdir(ck.folder)
    assert not any(n.startswith(".staging") for n in names)
