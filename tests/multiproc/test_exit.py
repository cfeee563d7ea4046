"""Ranks that end without close(): none waits out slot_timeout_s for another that is gone."""

from __future__ import annotations

import os
import time

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "exit_script.py")


def test_a_rank_that_fails_with_nothing_in_flight_does_not_hold_up_rank_0s_exit(local_dir):
    """Rank 1 raised in its training code with no save in flight, so its exit hook did
    nothing; rank 0, draining a save at exit, then waited slot_timeout_s (90 s here) for
    rank 1 to check out of the job store rank 0 hosts."""
    t0 = time.monotonic()
    job = launch([SCRIPT], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(150)
    took = time.monotonic() - t0
    assert codes == [3, 1], [job.output(r)[-3000:] for r in range(2)]
    assert "the training code failed on rank 1" in job.output(1)
    assert "finishing the save(s) of step(s) [10]" in job.output(0), job.output(0)[-3000:]
    assert took < 60, (took, job.output(0)[-3000:])
    # step 10's replication broke: the partner gone is named (gloo names only an address)
    assert "with partner rank 1" in job.output(0), job.output(0)[-3000:]
