"""Replica placement and restore planning: pure functions on fake topologies."""

from __future__ import annotations

import pytest

from incluster.recovery.plan import RankPlan, make_plan
from incluster.topology import Topology, replica_sources, replica_targets


@pytest.mark.parametrize(
    "nodes,replicas,expected",
    [
        (["A", "B", "C", "D"], 1, {0: [1], 1: [2], 2: [3], 3: [0]}),
        (["A", "B", "C", "D"], 2, {0: [1, 2], 1: [2, 3], 2: [3, 0], 3: [0, 1]}),
        (["A", "A", "B", "B"], 1, {0: [2], 1: [3], 2: [0], 3: [1]}),  # same local rank
        (["A", "A", "B"], 1, {0: [2], 1: [2], 2: [0]}),  # fewer ranks on the target: wraps
        (["A", "B"], 5, {0: [1], 1: [0]}),  # capped at one per other node
        (["A", "A"], 1, {0: [], 1: []}),  # one node: nowhere to put a replica
    ],
)
def test_replica_targets(nodes, replicas, expected):
    topo = Topology.from_nodes(nodes)
    for r, targets in expected.items():
        assert replica_targets(topo, r, replicas) == targets
        for t in targets:
            assert topo.node_of[t] != topo.node_of[r], "a replica never lives on its owner's node"


def test_sources_are_the_inverse_of_targets():
    topo = Topology.from_nodes(["A", "A", "B", "C", "C", "C"])
    for r in range(topo.world_size):
        for src, k in replica_sources(topo, r, 2):
            assert replica_targets(topo, src, 2)[k - 1] == r


def _holdings(nodes, replicas, steps):
    """Who holds what after saves of ``steps`` with every replica placed."""
    topo = Topology.from_nodes(nodes)
    held: dict[str, set] = {n: set() for n in topo.nodes}
    for step in steps:
        for r in range(topo.world_size):
            held[topo.node_of[r]].add((r, step))
            for t in replica_targets(topo, r, replicas):
                held[topo.node_of[t]].add((r, step))
    return held


def test_same_nodes_everything_local():
    held = _holdings(["A", "B", "C", "D"], 1, [10, 20])
    plan = make_plan(Topology.from_nodes(["A", "B", "C", "D"]), held)
    assert plan.step == 20
    assert all(p.source is None and p.sends == () for p in plan.ranks)
    # every rank learns no shard moves, so none waits on a round about senders' copies
    assert not any(p.transfers for p in plan.ranks)


def test_the_talks_scenario_spare_in_and_swap():
    """Nodes A-D, replicas 1; B dies, spare E takes its place; A and C swap positions."""
    held = _holdings(["A", "B", "C", "D"], 1, [10, 20])
    del held["B"]
    held["E"] = set()
    after = Topology.from_nodes(["C", "E", "A", "D"])  # rank 0 now on C, rank 1 on E, rank 2 on A
    plan = make_plan(after, held)
    assert plan.step == 20
    # rank 0's shard lives on A (own) -> sent by rank 2, who now runs on A
    assert plan.ranks[0] == RankPlan(20, source=2, sends=(1,), source_node="A")
    # rank 1's shard: B is gone, its replica is on C, where rank 0 runs now
    assert plan.ranks[1].source == 0 and plan.ranks[1].source_node == "C"
    # rank 2's shard: on C (own) and D (replica); C's rank 0 already sends once -> D's rank 3
    assert plan.ranks[2].source == 3
    assert plan.ranks[3].source is None  # D kept its place
    assert sorted(plan.ranks[0].sends) == [1] and plan.ranks[3].sends == (2,) and plan.ranks[2].sends == (0,)
    # rank 3 neither sends to itself nor receives, yet must join the senders' round
    assert all(p.transfers for p in plan.ranks)


def test_lost_node_and_its_partner_falls_back_or_reports_missing():
    held = _holdings(["A", "B", "C", "D"], 1, [10, 20])
    held["C"].add((1, 5))  # an old, complete-looking step does not exist for others
    del held["A"], held["B"]  # rank 0 lives on A and is replicated on B: both gone
    plan = make_plan(Topology.from_nodes(["E", "F", "C", "D"]), held)
    assert plan.step is None
    assert plan.missing[20] == [0] and plan.missing[10] == [0]
    # an older step complete elsewhere is used
    held["C"].update({(0, 15), (1, 15), (2, 15), (3, 15)})
    assert make_plan(Topology.from_nodes(["E", "F", "C", "D"]), held).step == 15


def test_excluded_copy_makes_the_plan_use_the_replica():
    held = _holdings(["A", "B", "C", "D"], 1, [20])
    plan = make_plan(Topology.from_nodes(["A", "B", "C", "D"]), held, exclude={("A", 0, 20)})
    assert plan.ranks[0].source == 1 and plan.ranks[0].source_node == "B"


def test_plan_ignores_dead_nodes_and_foreign_ranks():
    held = _holdings(["A", "B"], 1, [20])
    held["Z"] = {(0, 30), (1, 30)}  # a node not in the job any more
    held["A"].add((7, 40))  # a rank this job does not have
    assert make_plan(Topology.from_nodes(["A", "B"]), held).step == 20


def test_plan_is_deterministic_and_spreads_sources():
    nodes = [f"n{i // 2}" for i in range(16)]
    held = _holdings(nodes, 1, [1])
    del held["n0"]
    topo = Topology.from_nodes(["spare", "spare"] + nodes[2:])
    a, b = make_plan(topo, held), make_plan(topo, held)
    assert a == b
    assert a.ranks[0].source != a.ranks[1].source  # two receivers, two different senders
