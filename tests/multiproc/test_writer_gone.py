"""A rank whose writer process is gone for good: the other ranks' saves fail at once,
naming it, and say so once - not a warning per save for the rest of the run."""

from __future__ import annotations

import os
import re

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "writer_gone_script.py")


def test_a_partner_whose_writer_is_gone_fails_each_step_at_once_and_is_warned_of_once(local_dir):
    job = launch([SCRIPT], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(200)
    out0, out1 = job.output(0), job.output(1)
    assert codes == [0, 0], [out0[-3000:], out1[-3000:]]
    assert len(re.findall(r"step \d FAILED .*WriterProcessDied.*not started again", out1)) == 6, out1[-3000:]
    failed = re.findall(r"step (\d) FAILED after ([0-9.]+) s: (.*)", out0)
    assert [int(s) for s, _, _ in failed] == list(range(1, 7)), out0[-3000:]
    for _, took, why in failed:
        assert float(took) < 15, why
        # rank 1's refused save() publishes its reason; or the replica exchange finds its writer gone
        assert ("failed on rank 1 (save() raised on rank 1: WriterProcessDied" in why and "not started again" in why
                or "rank [1]'s writer is gone for good" in why and "until the job restarts" in why), why
    assert "WARNINGS 2" in out0, out0[-3000:]  # the first, and one saying the rest go to INFO
