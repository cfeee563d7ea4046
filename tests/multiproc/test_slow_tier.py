"""A persistent tier that is slow on one rank never holds up saves (the README's promise):
on any rank, a due upload skipped while the previous one runs costs that save nothing."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "slow_tier_script.py")
LATENCY_S = 1.5  # per tier call on rank 0: its first upload takes several seconds


def test_a_tier_slow_on_rank_0_holds_up_no_rank_s_saves(local_dir, tmp_path):
    """Rank 1's upload of step 1 waited on its job-store client for rank 0's gate and then
    for the step's outcome; the skip of step 2, published on the same client from the
    commit thread, queued behind that wait. Step 2 became durable only once the upload
    ended, the ring filled, and save() blocked for seconds on every rank."""
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out, str(tmp_path / "tier"), str(LATENCY_S)], nodes=["n0", "n1"], ranks_per_node=1,
                 base_dir=local_dir)
    codes = job.wait(180)
    assert codes == [0, 0], [job.output(r)[-3000:] for r in range(2)]
    for rank in (0, 1):
        res = json.load(open(os.path.join(out, f"result-r{rank}.json")))
        assert max(res["blocked"]) < 1.0, (rank, res)
        # Step 1 is durable before its upload ends; so is every later step (their uploads skipped).
        assert max(res["durable"]) < LATENCY_S, (rank, res)
