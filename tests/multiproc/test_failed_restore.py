"""A restore that finds no usable step must leave what it found as it was: it used to
un-commit every newer step as soon as it planned an older one, so good copies of step 30
on a healthy rank were gone after a restore that then failed - a node coming back with the
one missing copy could no longer restore step 30."""

from __future__ import annotations

import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "failed_restore_script.py")


def test_a_restore_that_fails_un_commits_no_good_copy(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)

    def run(phase: str) -> list[str]:
        job = launch([SCRIPT, out, phase], nodes=["A", "B"], ranks_per_node=1, base_dir=local_dir)
        assert job.wait(120) == [0, 0], [job.output(r) for r in range(2)]
        return [open(os.path.join(out, f"{phase}-r{r}.txt")).read() for r in range(2)]

    run("save")
    own0 = os.path.join(local_dir, "A", "failed", "rank-00000")
    own1 = os.path.join(local_dir, "B", "failed", "rank-00001")
    for step in (25, 30):  # every copy of rank 0's steps goes bad
        with open(os.path.join(own0, f"step-{step:012d}.safetensors"), "r+b") as f:
            f.seek(-50, os.SEEK_END)
            byte = f.read(1)
            f.seek(-50, os.SEEK_END)
            f.write(bytes([byte[0] ^ 1]))
    said = run("load")
    assert all("CheckpointError" in s and "copies of step(s) [25, 30] failed verification" in s for s in said), said
    for step in (25, 30):  # rank 1's good copies are still committed
        assert os.path.exists(os.path.join(own1, f"step-{step:012d}.json")), (step, os.listdir(own1))
