"""A restore that one rank cannot finish: every rank stops together with a CheckpointError
at once (not in a collective until the lingering rank exits or the process group times
out), and a rank that could not heal its node's copy still takes part in a second round."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from incluster.testing.faults import FaultInjector
from incluster.testing.launch import launch

from helpers import flip_byte

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "restore_stop_script.py")


def _run(local_dir, nodes, case, *extra):
    out = os.path.join(local_dir, "out")
    os.makedirs(out, exist_ok=True)
    job = launch([SCRIPT, out, "save", case, *extra], nodes=nodes, ranks_per_node=1, base_dir=local_dir)
    assert job.wait(120) == [0] * len(nodes), [job.output(r) for r in range(len(nodes))]
    return out


def _load(local_dir, out, nodes, case, *extra, env):
    job = launch([SCRIPT, out, "load", case, *extra], nodes=nodes, ranks_per_node=1, base_dir=local_dir, env=env)
    codes = job.wait(150)
    assert codes == [0] * len(nodes), [job.output(r)[-3000:] for r in range(len(nodes))]
    return [json.load(open(os.path.join(out, f"result-load-r{r}.json"))) for r in range(len(nodes))]


@pytest.mark.timeout(300)
def test_a_live_state_one_rank_cannot_take_stops_every_rank_at_once(local_dir):
    nodes = ["n0", "n1"]
    out = _run(local_dir, nodes, "shape")
    res = _load(local_dir, out, nodes, "shape", env={"KEEP": "10"})
    assert "rank 1 cannot load step 2" in res[1]["error"] and "shape" in res[1]["error"], res
    assert "other rank(s) cannot load" in res[0]["error"], res
    assert res[0]["seconds"] < 8, res  # not until rank 1 exits


@pytest.mark.timeout(300)
def test_no_room_for_a_persistent_copy_on_one_node_stops_every_rank_at_once(local_dir):
    nodes, tier = ["n0", "n1"], os.path.join(local_dir, "tier")
    out = _run(local_dir, nodes, "-", tier)
    for n in nodes:
        shutil.rmtree(os.path.join(local_dir, n))  # both nodes lost: the persistent tier only
    full = FaultInjector().fail_at(phase="allocate", rank=1, step=2, action="enospc").env()
    res = _load(local_dir, out, nodes, "-", tier, env={**full, "KEEP": "10"})
    assert "rank 1 cannot load step 2" in res[1]["error"], res
    assert "other rank(s) cannot load" in res[0]["error"] and res[0]["seconds"] < 8, res


@pytest.mark.timeout(300)
def test_a_rank_that_could_not_heal_its_copy_receives_again_in_the_next_round(local_dir):
    """n2 is replaced by an empty spare whose RAM disk is full: rank 2 receives its shard but
    cannot write its node's copy; rank 0's own copy is corrupt, so a second round follows
    in which rank 2 is planned to receive again (its node still has no copy)."""
    nodes = ["n0", "n1", "n2"]
    out = _run(local_dir, nodes, "-")
    shutil.rmtree(os.path.join(local_dir, "n2"))
    path = os.path.join(local_dir, "n0", "stop", "rank-00000", "step-000000000002.safetensors")
    flip_byte(path)
    full = FaultInjector().fail_at(phase="allocate", rank=2, step=2, action="enospc").env()
    res = _load(local_dir, out, nodes, "-", env=full)
    assert all(r.get("loaded") == 2 and r.get("equal") for r in res), res


@pytest.mark.timeout(300)
def test_a_resharded_restore_one_rank_cannot_finish_stops_every_rank(local_dir):
    """Saved by 2 ranks, restored into 3: rank 2's object refuses its values after the
    pieces moved; ranks 0 and 1 must not return the step while rank 2 raises."""
    out = _run(local_dir, ["n0", "n1"], "object")
    res = _load(local_dir, out, ["n0", "n1", "n2"], "object", env={})
    assert "this counter takes no saved value" in res[2]["error"], res
    assert all("another rank cannot restore step 2" in r.get("error", "") for r in res[:2]), res
