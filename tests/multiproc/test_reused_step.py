"""A step number saved again after a load() that went back past it is a new step: its
outcome is decided by this save's commits, never by the job store's record of the step
that had that number before."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "reused_step_script.py")


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_step_number_saved_again_after_going_back_is_decided_anew(local_dir, writer):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir, env={"WRITER": writer})
    codes = job.wait(120)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    r0, r1 = (json.load(open(os.path.join(out, f"result-r{r}.json"))) for r in range(2))
    for res in (r0, r1):
        assert [res[s] for s in ("2", "4", "6")] == ["durable"] * 3, (r0, r1)
        assert res["load"] == 4, res  # every copy of step 6 was made unusable
        assert res["8"] == "durable", (r0, r1)
    # Rank 1 refused its second save(6): that step 6 can never be whole. Rank 0's handle
    # read the first step 6's "ok" and said durable.
    assert r1["6 again"] == "refused", r1
    assert r0["6 again"] != "durable" and "rank 1" in r0["6 again"], r0
