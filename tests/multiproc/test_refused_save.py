"""A save() that raises on one rank is published as failed at once: the other ranks do
not wait slot_timeout_s for it, and every rank's next save lands."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "refused_save_script.py")


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_refused_save_fails_the_step_everywhere_at_once(local_dir, writer):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir, env={"WRITER": writer})
    codes = job.wait(150)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    res = [json.load(open(os.path.join(out, f"result-r{r}.json"))) for r in range(2)]
    assert "cannot checkpoint" in res[1]["step2"], res[1]
    assert res[0]["step2"] != "durable" and "rank 1" in res[0]["step2"], res[0]
    assert res[0]["step2_s"] < 20, f"rank 0 waited {res[0]['step2_s']:.0f} s for a step rank 1 had refused"
    assert res[0]["step3"] == "durable" and res[1]["step3"] == "durable", res
