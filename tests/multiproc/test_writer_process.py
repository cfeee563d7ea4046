"""The writer process: started once, watched, bounded waits, dies with its trainer."""

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
from incluster.testing import FaultInjector

pytestmark = pytest.mark.multiproc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_writer_process_commits_and_is_reused(local_dir):
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        pid = ck.writer_pid
        assert pid and pid != os.getpid() and _alive(pid)
        for step in range(1, 5):
            ck.save(step, {"w": torch.full((1000,), float(step))}).wait()
        assert ck.writer_pid == pid
    assert not _alive(pid)
    target = {"w": torch.zeros(1000)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 4 and torch.equal(target["w"], torch.full((1000,), 4.0))


def test_killed_writer_is_reported_with_pid_and_signal(local_dir):
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        pid = ck.writer_pid
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
        with pytest.raises(incluster.WriterProcessDied, match=rf"pid {pid}.*SIGKILL"):
            ck.save(2, {"w": torch.ones(10)}).wait()
        with pytest.raises(incluster.WriterProcessDied):
            ck.save(3, {"w": torch.ones(10)}).wait()
        target = {"w": torch.zeros(10)}
        assert ck.load(target) == 1 and torch.equal(target["w"], torch.ones(10))


def test_no_free_slot_times_out_and_keeps_the_newest_step(local_dir, monkeypatch):
    marker_dir = os.path.join(local_dir, "m")
    os.makedirs(marker_dir)
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="commit", step=2, action="hang", marker_dir=marker_dir).env().items())))
    ck = incluster.Checkpointer(local_dir=local_dir, job="w", slot_timeout_s=1.5)
    try:
        ck.save(1, {"w": torch.ones(10)}).wait()
        ck.save(2, {"w": torch.ones(10) * 2})  # its commit hangs in the writer
        t = time.monotonic()
        with pytest.raises(incluster.PeerTimeoutError, match="no checkpoint slot became free"):
            ck.save(3, {"w": torch.ones(10) * 3})
        assert 1.0 < time.monotonic() - t < 10
        assert os.path.exists(os.path.join(ck.folder, "step-000000000001.json"))
    finally:
        pid = ck.writer_pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(incluster.CheckpointError):
            ck.close()


CHILD = textwrap.dedent(
    """
    import sys, time, torch, incluster
    ck = incluster.Checkpointer(local_dir=sys.argv[1], job="orphan")
    ck.save(1, {"w": torch.ones(4)}).wait()
    print(ck.writer_pid, flush=True)
    time.sleep(600)
    """
)


def test_writer_exits_when_its_trainer_is_killed(local_dir):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, local_dir], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert _alive(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the writer outlived its trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
