"""load(state, step=N) on two nodes rolls every rank back to step N, and the saves after
it are the timeline a later restore takes - not the newer steps it went back from."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "rollback_script.py")


def test_a_rollback_restores_the_named_step_everywhere_and_its_timeline_goes_on(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(120)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    for r in range(2):
        res = json.load(open(os.path.join(out, f"result-r{r}.json")))
        assert "error" not in res, res.get("error")
        assert [res[s] for s in ("2", "4", "6", "8", "5")] == ["durable"] * 5, res
        assert res["rollback"] == 4 and res["rollback_values"] is True, res
        assert res["reload"] == 5 and res["reload_values"] is True, res
