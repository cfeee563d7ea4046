"""A partner that is slow to exchange replicas delays only the steps it holds up
(their ``durable``), never this rank's later local commits."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.faults import FaultInjector
from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "slow_partner_script.py")
SLOW_S = 8.0


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_slow_partner_does_not_hold_up_local_commits(local_dir, writer):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    faults = FaultInjector().fail_at(phase="replicate", rank=1, step=1, action="slow", seconds=SLOW_S).env()
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir, env={"WRITER": writer, **faults})
    codes = job.wait(150)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    res = [json.load(open(os.path.join(out, f"result-r{r}.json"))) for r in range(2)]
    assert res[0]["durable"] == [1, 2, 3] and res[1]["durable"] == [1, 2, 3], res
    # Step 3 is in rank 0's RAM as soon as it is checksummed, not after rank 1 wakes up.
    assert res[0]["local3_s"] < SLOW_S / 2, res[0]
