"""A step is durable once every rank committed it: rank 0 may return from wait() and
die at once, taking the job store (served by its process) with it, while rank 1 still
waits for that step's outcome. Rank 1 then cannot know the outcome; un-committing its
copy (and the replica of rank 0's shard it holds) lost a step reported durable."""

from __future__ import annotations

import os
import shutil

import pytest

from incluster.testing import FaultInjector
from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "durable_then_lost_script.py")


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_step_reported_durable_survives_rank_0_dying_right_after(local_dir, writer):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    nodes = ["n0", "n1"]
    # rank 1's writer asks for step 3's outcome 2 s late, when rank 0, told the step is
    # durable, is surely gone
    late = FaultInjector().fail_at(phase="outcome", step=3, action="slow", seconds=2.0).env()
    job = launch([SCRIPT, "save", out], nodes=nodes, ranks_per_node=1, base_dir=local_dir, env={"WRITER": writer},
                 rank_env={1: late})
    job.wait(150)
    shutil.rmtree(os.path.join(local_dir, "n0"))  # and rank 0's node lost its RAM: the replica on n1 must be there
    job = launch([SCRIPT, "load", out], nodes=nodes, ranks_per_node=1, base_dir=local_dir, env={"WRITER": writer})
    assert job.wait(150) == [0, 0], [job.output(r) for r in range(2)]
    for r in range(2):
        assert open(os.path.join(out, f"loaded-r{r}")).read() == "3 True", [job.output(r) for r in range(2)]
