"""Rank 0's process (the job store's host) dies: the others are told so in words, their
logs are not flooded, and close() does not wait on the dead address."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "store_lost_script.py")


def test_the_store_hosts_death_is_named_and_costs_close_no_connect_timeouts(local_dir):
    """Each save failed as "writer failed to commit step N: Broken pipe", every failing
    store call logged a C++ backtrace (thousands of lines), and close() spent a connect
    timeout per new store client: 36-52 s with slot_timeout_s=20."""
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(180)
    assert codes[1] == 0 and codes[0] != 0, (codes, job.output(1)[-3000:])
    res = json.load(open(os.path.join(out, "result-r1.json")))
    later = [res["errors"].get(str(s), "") for s in range(4, 8)]
    assert all("lost the job store (rank 0's, at " in e and "until the job restarts" in e for e in later), res
    assert res["close_s"] < 10, res  # no connect timeout (10 s) spent on the dead store
    frames = sum(line.startswith("frame #0") for line in job.output(1).splitlines())
    assert frames <= 4, f"{frames} C++ backtraces in rank 1's log"
