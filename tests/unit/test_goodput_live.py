"""Goodput measured on a real Checkpointer: what a SIGKILL costs lands in lost progress."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from incluster.goodput.report import build_report

# attempt 0 trains until it kills itself; attempt 1 restores and ends
PREAMBLE = """
import os, signal, sys, time
import torch
import incluster

local_dir, run_dir, attempt = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "opt": opt}
ck = incluster.Checkpointer(local_dir=local_dir, job="g", writer="thread", run_dir=run_dir)
start = ck.load(state)
if attempt == 1:
    ck.close()
    sys.exit(0)
"""

CHILD = PREAMBLE + """for step in range(100):
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
    if step == 20:
        ck.save(step, state).wait()
        saved = time.time()
    if step > 20 and time.time() - saved >= 1.2:
        os.kill(os.getpid(), signal.SIGKILL)  # 1.2 s of training after the last save is lost
"""


LONG_STEPS = PREAMBLE + """for step in range(100):
    if step == 2:
        ck.save(step, state).wait()
        saved = time.time()
    model(torch.randn(4, 16)).sum().backward()
    time.sleep(0.9)  # a long forward and backward
    if step > 2 and time.time() - saved >= 2.7:
        os.kill(os.getpid(), signal.SIGKILL)  # 0.9 s into a step; 2.7 s after the save, all lost
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.timeout(120)
def test_a_kill_inside_a_long_step_loses_the_step_begun_too(local_dir, tmp_path: Path) -> None:
    """Steps of 0.9 s, killed 0.9 s into one, 2.7 s after the last save: the recorder's
    `alive` events said when the latest step began, so the report took the process for
    dead 0.9 s before the kill and counted that part of the lost work as restart."""
    run_dir = tmp_path / "run"
    for attempt in (0, 1):
        p = subprocess.run([sys.executable, "-c", LONG_STEPS, local_dir, str(run_dir), str(attempt)],
                           capture_output=True, text=True, timeout=90)
        assert p.returncode == (-9 if attempt == 0 else 0), p.stderr[-3000:]
    lost = build_report(run_dir).to_dict()["badput_s"]["lost_progress"]
    assert 2.0 <= lost <= 2.8, lost  # about 0.5 s (the recorder's interval) short of 2.7 s at most; 1.8 before


@pytest.mark.timeout(120)
def test_work_since_the_last_save_that_a_sigkill_lost_is_lost_progress_without_record_step(local_dir, tmp_path: Path) -> None:
    """No record_step() calls: the report used to see progress only at saves, so the
    1.2 s trained after the last save was counted as restart time, not lost progress."""
    run_dir = tmp_path / "run"
    for attempt in (0, 1):
        p = subprocess.run([sys.executable, "-c", CHILD, local_dir, str(run_dir), str(attempt)],
                           capture_output=True, text=True, timeout=90)
        assert p.returncode == (-9 if attempt == 0 else 0), p.stderr[-3000:]
    rep = build_report(run_dir)
    assert rep.attempts == 2
    lost = rep.to_dict()["badput_s"]["lost_progress"]
    assert 0.6 <= lost <= 1.4, rep.to_dict()["badput_s"]


@pytest.mark.timeout(120)
def test_waits_inside_load_and_close_are_checkpoint_time_not_goodput(local_dir, tmp_path: Path, monkeypatch) -> None:
    """close() waits for an upload (a tier answering each call 0.6 s late): that was
    counted as training, since close() wrote nothing of its own. The writer process's
    start (here held 2 s) is waited for by neither load() nor training: it overlaps them."""
    import time

    import torch

    import incluster
    from incluster.testing import SlowTier
    from incluster.testing.faults import FaultInjector
    from incluster.tiers.persistent import FsspecTier

    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="writer-start", action="slow", seconds=2).env().items())))
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt}
    tier = SlowTier(FsspecTier(str(tmp_path / "tier")), latency_s=0.6)
    ck = incluster.Checkpointer(local_dir=local_dir, job="g", run_dir=str(tmp_path / "run"), persistent=tier,
                                persistent_every=1000)
    t0 = time.monotonic()
    assert ck.load(state) is None
    t1 = time.monotonic()
    for step in range(10):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.record_step(step)
        time.sleep(0.05)
    ck.save(10, state, persist=True).wait()
    t2 = time.monotonic()
    ck.close()  # waits for the upload: several tier calls
    t3 = time.monotonic()
    assert t1 - t0 < 2 and t3 - t2 >= 1.2, (t1 - t0, t3 - t2)  # load() did not wait for the writer
    acc = build_report(tmp_path / "run").per_rank[0]
    assert acc["checkpoint_load"] >= 0.9 * (t1 - t0), acc
    assert acc["checkpoint_save"] >= 0.9 * (t3 - t2), acc
    assert acc["goodput"] <= (t2 - t1) + 0.3, (acc, t2 - t1)
