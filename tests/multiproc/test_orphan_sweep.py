"""Copies left on a node by an earlier layout are removed once the new layout has made two
steps durable: ranks that moved to other nodes no longer fill this node's RAM disk."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "orphan_sweep_script.py")


def _run(local_dir, out, phase, nodes):
    job = launch([SCRIPT, out, phase], nodes=nodes, ranks_per_node=1, base_dir=local_dir)
    assert job.wait(150) == [0] * len(nodes), [job.output(r)[-3000:] for r in range(len(nodes))]
    return [json.load(open(os.path.join(out, f"{phase}-r{r}.json"))) for r in range(len(nodes))]


def _folders(local_dir, node):
    base = os.path.join(local_dir, node, "sweep")
    return sorted(n for n in os.listdir(base) if n.startswith("rank-"))


@pytest.mark.timeout(400)
def test_a_node_drops_the_copies_of_ranks_that_moved_away(local_dir, tmp_path):
    out = str(tmp_path)
    _run(local_dir, out, "first", ["a", "b", "c"])  # replicas: 0 (a) -> b, 1 (b) -> c, 2 (c) -> a
    assert _folders(local_dir, "a") == ["rank-00000", "rank-00002"]
    # Ranks 0 and 1 swap nodes: 0 (b) -> a, 1 (a) -> c, 2 (c) -> b. Node a no longer keeps
    # rank 2's copies, node b none of rank 1's.
    moved = _run(local_dir, out, "moved", ["b", "a", "c"])
    assert [m["restored"] for m in moved] == [4, 4, 4]
    assert _folders(local_dir, "a") == ["rank-00000", "rank-00001"]
    assert _folders(local_dir, "b") == ["rank-00000", "rank-00002"]
    assert _folders(local_dir, "c") == ["rank-00001", "rank-00002"]
    again = _run(local_dir, out, "again", ["b", "a", "c"])
    assert [(a["restored"], a["w"]) for a in again] == [(8, 80.0), (8, 81.0), (8, 82.0)]
