"""A node away while a restore went back past a step, back later with its old copies:
the restore must never combine them with the later timeline's copies of the same step
(each copy intact, the state torn), nor prefer the abandoned timeline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "stale_timeline_script.py")


def _run(local_dir: str, out: str, phase: str, nodes: list[str]) -> list[dict]:
    job = launch([SCRIPT, out, phase], nodes=nodes, ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(120)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    return [json.load(open(os.path.join(out, f"{phase}-r{r}.json"))) for r in range(2)]


def test_a_returning_node_never_brings_back_an_abandoned_timeline(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    a, b, c = (os.path.join(local_dir, n) for n in "ABC")
    first = _run(local_dir, out, "first", ["A", "B"])
    shard = os.path.join(a, "stale", "rank-00000", f"step-{20:012d}.safetensors")
    with open(shard, "r+b") as f:  # rank 0's own copy of step 20 goes bad
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    os.rename(b, b + ".away")  # node B is away (its RAM kept): its copies of step 20 are not seen
    second = _run(local_dir, out, "second", ["A", "C"])
    assert [r["load"] for r in second] == [15, 15]  # rank 0's step 20 is bad, its replica on B away
    assert all(r["saved"]["20"] != f["saved"]["20"] for r, f in zip(second, first))
    shutil.rmtree(c)
    os.rename(b + ".away", b)  # B is back with the first run's step 20 (both ranks' copies)
    third = _run(local_dir, out, "third", ["A", "B"])
    # Step 20 of the second run: rank 0's own copy on A, rank 1's replica on A. Before,
    # rank 1 took the first run's step 20 from its own node B: a torn state.
    for r, s in zip(third, second):
        assert r["load"] == 20 and r["after_load"] == s["saved"]["20"], (third, second)
    # rank 1's node healed its own copy of the later step 20 (the old one made way for it)
    from incluster.format.sidecar import read_sidecar

    healed = read_sidecar(os.path.join(b, "stale", "rank-00001", f"step-{20:012d}.json"))
    assert healed.lineage == read_sidecar(os.path.join(a, "stale", "rank-00000", f"step-{20:012d}.json")).lineage
    cli = subprocess.run([sys.executable, "-m", "incluster", "verify", a, b], capture_output=True, text=True)
    assert "newest step with a good copy of every rank is 20" in cli.stdout or "step 20 has a good copy" in cli.stdout, cli.stdout
