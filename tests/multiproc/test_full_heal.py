"""A peer restore into a node whose RAM disk is full: the state is restored (verified),
the node's copy is skipped with a warning, nobody hangs, and the next save lands."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from incluster.testing.faults import FaultInjector
from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "full_heal_script.py")


def test_restore_into_a_full_node_still_restores(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out, "save"], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    assert job.wait(120) == [0, 0], [job.output(r) for r in range(2)]
    shutil.rmtree(os.path.join(local_dir, "n1"))  # node n1 was replaced: its RAM is empty
    full = FaultInjector().fail_at(phase="allocate", rank=1, step=2, action="enospc").env()
    job = launch([SCRIPT, out, "load"], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir, env=full)
    codes = job.wait(120)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    res = [json.load(open(os.path.join(out, f"result-load-r{r}.json"))) for r in range(2)]
    assert res[1] == {"loaded": 2, "equal": True, "source": "peer", "step3": "durable"}, res
    assert res[0]["loaded"] == 2 and res[0]["equal"] and res[0]["step3"] == "durable", res
    assert "cannot be written" in job.output(1), job.output(1)
