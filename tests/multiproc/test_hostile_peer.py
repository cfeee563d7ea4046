"""What peers send is data, bounded before anything is allocated."""

from __future__ import annotations

import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "hostile_peer_script.py")


def test_a_peer_announcing_a_huge_record_is_refused_and_the_job_goes_on(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    assert job.wait(60) == [0, 0], [job.output(r) for r in range(2)]
    r0 = open(os.path.join(out, "r0.txt")).read()
    assert r0.startswith("refused") and "announced records over" in r0, r0
    assert open(os.path.join(out, "r1.txt")).read() == "scatter {'to': 1}"
