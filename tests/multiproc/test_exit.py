"""Ranks that end without close(): none waits out slot_timeout_s for another that is gone."""

from __future__ import annotations

import os
import re
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
    # step 10 failed naming rank 1: it left after step 5, or (first) its replica pair broke
    out = job.output(0)
    assert "rank 1 exited without close() (its training code raised?) after step 5 and saves no more" in out or (
        "with partner rank 1" in out), out[-3000:]


@pytest.mark.parametrize("saves,how", [(1, "raise"), (0, "raise"), (0, "close")])
def test_a_step_a_rank_that_left_never_saves_fails_at_once(local_dir, saves, how):
    """Rank 1 left (raised, or closed) after ``saves`` saves; rank 0's next save, tied to
    rank 1 by no replica exchange, waited slot_timeout_s (90 s) for rank 1's commit before
    it failed. Closed before any save, rank 1's writer had no save to mark the end after."""
    job = launch([SCRIPT, "alone", str(saves), how], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(150)
    out = job.output(0)
    assert codes == [0, 1 if how == "raise" else 0], [job.output(r)[-3000:] for r in range(2)]
    m = re.search(r"FAILED after ([0-9.]+) s: (.*)", out)
    assert m, out[-3000:]
    assert float(m.group(1)) < 20, m.group(0)
    what = "closed its Checkpointer" if how == "close" else "exited without close() (its training code raised?)"
    since = f"after step {(saves - 1) * 5}" if saves else "without saving a step since it started"
    assert f"rank 1 {what} {since}" in m.group(2) and "saves no more" in m.group(2), m.group(0)
