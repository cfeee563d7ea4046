"""Restore planning with identical shards: a rank whose every copy is lost or bad is
rebuilt where a data-parallel peer's byte-identical shard is, by forwarding its sidecar."""

from __future__ import annotations

from incluster.recovery.equivalent import SIDECAR_BAD
from incluster.recovery.plan import make_plan
from incluster.topology import Topology

C = 0x1234  # the content id every data-parallel rank's shard shares
W = 4


def _ddp(nodes_held: dict[str, list[tuple]], step: int = 2) -> dict[str, list[tuple]]:
    """(owner, size) per node -> inventory items of one step; size -1: sidecar only."""
    return {n: [(o, step, size, W, C) for o, size in items] for n, items in nodes_held.items()}


# replicas=1, DDP: node i holds its own shard and rank i-1's shared replica (same bytes)
HELD = {"n0": [(0, 100), (3, 100)], "n2": [(2, 100), (1, 100)], "n3": [(3, 100), (2, 100)]}
LIVE = Topology.from_nodes(["n0", "spare", "n2", "n3"])


def test_lost_node_uses_the_ordinary_replica_first():
    plan = make_plan(LIVE, _ddp(HELD))
    assert plan.step == 2 and not any(p.forwarding for p in plan.ranks)
    assert plan.ranks[1].source == 2  # rank 1's replica on n2


def test_bad_shared_copy_is_rebuilt_on_a_node_with_identical_bytes():
    # rank 2's file on n2 is corrupt: rank 1's shared copy there and rank 2's own are bad
    exclude = {("n2", 1, 2), ("n2", 2, 2)}
    plan = make_plan(LIVE, _ddp(HELD), exclude)
    assert plan.step == 2 and all(p.forwarding for p in plan.ranks)
    (owner, to), = plan.ranks[2].forward_send  # the rank on n2, where rank 1's sidecar is
    assert owner == 1 and LIVE.node_of[to] in ("n0", "n3")
    assert plan.ranks[to].forward_recv[0][:2] == (1, 2) and plan.ranks[to].forward_recv[0][3] == "n2"
    # once rebuilt, the next plan restores rank 1 from there like any copy
    healed = {**_ddp(HELD), LIVE.node_of[to]: _ddp(HELD)[LIVE.node_of[to]] + [(1, 2, 100, W, C)]}
    nxt = make_plan(LIVE, healed, exclude)
    assert not any(p.forwarding for p in nxt.ranks) and nxt.ranks[1].source == to


def test_a_sidecar_without_its_bytes_is_forwarded_and_home_is_preferred():
    # two ranks per node: rank 1's own node still holds rank 0's identical shard
    topo = Topology.from_nodes(["a", "a", "b", "b"])
    held = {"a": [(0, 2, 100, W, C), (1, 2, -1, W, C)], "b": [(2, 2, 100, W, C), (3, 2, 100, W, C)]}
    plan = make_plan(topo, held)
    assert plan.ranks[1].forward_send == ((1, 1),) and plan.ranks[1].forward_recv == ((1, 1, 0, "a"),)


def test_no_stand_in_without_the_sidecar_or_identical_content():
    exclude = {("n2", 1, 2), ("n2", 2, 2), (SIDECAR_BAD + "n2", 1, 2)}  # its sidecar too
    plan = make_plan(LIVE, _ddp(HELD), exclude)
    assert plan.step is None and plan.missing[2] == [1]
    other = {n: [(o, s, sz, w, 0x999 if o != 1 else C) for o, s, sz, w, _ in items] for n, items in _ddp(HELD).items()}
    plan = make_plan(LIVE, other, {("n2", 1, 2)})  # nobody else's bytes match rank 1's
    assert plan.step is None


def test_unknown_content_never_stands_in():
    held = {n: [(o, s, sz, w, 0) for o, s, sz, w, _ in items] for n, items in _ddp(HELD).items()}
    assert make_plan(LIVE, held, {("n2", 1, 2), ("n2", 2, 2)}).step is None


def test_a_rebuilt_copy_that_fails_is_not_rebuilt_on_the_same_node_again():
    exclude = {("n2", 1, 2), ("n2", 2, 2)}
    first = make_plan(LIVE, _ddp(HELD), exclude)
    (owner, to), = first.ranks[2].forward_send
    node = LIVE.node_of[to]
    healed = {**_ddp(HELD), node: _ddp(HELD)[node] + [(1, 2, 100, W, C)]}
    again = make_plan(LIVE, healed, exclude | {(node, 1, 2)})  # its bytes there failed too
    assert all(p.forwarding for p in again.ranks)
    (to2,) = [r for r, p in enumerate(again.ranks) if p.forward_recv]
    assert LIVE.node_of[to2] not in (node, "n2")
    last = {("n0", 1, 2), ("n3", 1, 2)}  # every node with identical bytes has failed rank 1
    assert make_plan(LIVE, healed, exclude | last).step is None
