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


def test_a_set_aside_record_is_forwarded_locally_without_a_process_group(local_dir):
    """One process, nothing to send: rank 1's record, set aside with its bad bytes, is
    committed as a shared copy of rank 0's identical shard (every record compared)."""
    import os
    from types import SimpleNamespace

    from incluster.format.checksum import compute
    from incluster.format.sidecar import Sidecar, read_sidecar, write_sidecar
    from incluster.recovery.forward import forward_sidecars
    from incluster.recovery.node import BAD_SUFFIX, FOLDER, node_inventory
    from incluster.recovery.plan import RankPlan
    from incluster.staging.slots import sidecar_file, step_file
    from incluster.tiers.local import data_path, rank_folder

    data = bytes(range(256)) * 64
    for r in (0, 1):
        os.makedirs(rank_folder(local_dir, "job", r))
        sc = Sidecar("job", 5, r, 2, "n0", step_file(5), compute(data, len(data)), "fp", {"d": []}, extra={"pos": r})
        write_sidecar(os.path.join(rank_folder(local_dir, "job", r), sidecar_file(5)), sc)
    with open(os.path.join(rank_folder(local_dir, "job", 0), step_file(5)), "wb") as f:
        f.write(data)
    one = os.path.join(rank_folder(local_dir, "job", 1), sidecar_file(5))
    os.replace(one, one + BAD_SUFFIX)  # its bytes failed: the record was set aside
    listed = node_inventory(local_dir, "job")
    assert not [i for i in listed if i[1] == FOLDER]  # every folder holds a record: none "never committed"
    inv = sorted(i for i in listed if i[1] != FOLDER)
    assert [i[:4] for i in inv] == [(0, 5, len(data), 2), (1, 5, -1, 2)] and inv[0][4] == inv[1][4] != 0
    ctx = SimpleNamespace(local_dir=local_dir, job="job", rank=0, node="n0")
    mine = RankPlan(5, forwarding=True, forward_send=((1, 0),), forward_recv=((1, 0, 0, "n0"),))
    healed, bad = forward_sidecars(ctx, mine)
    assert bad == [] and [h[:3] for h in healed] == [("n0", 1, 5)]
    rebuilt = read_sidecar(one)
    assert rebuilt.rank == 1 and rebuilt.extra["pos"] == 1 and rebuilt.extra["shared_with"] == 0
    assert data_path(rank_folder(local_dir, "job", 1), rebuilt) == os.path.join(rank_folder(local_dir, "job", 0), step_file(5))


def test_the_content_id_is_read_only_where_the_writer_puts_it(local_dir):
    import os

    from incluster.recovery.node import _head

    path = os.path.join(local_dir, "old.json")  # a record from before content ids, with a key named content
    with open(path, "w") as f:
        f.write('{"format":"incluster-sidecar","world_size":4,"node":"n0","tree":{"d":[["content",7]]}}')
    assert _head(path) == (4, 0, (0, 0, -1))
    with open(path, "w") as f:
        f.write('{"format":"incluster-sidecar","world_size":4,"content":-99,"node":"n0"}')
    assert _head(path) == (4, -99, (0, 0, -1))
    with open(path, "w") as f:  # the lineage, right after the content id
        f.write('{"format":"incluster-sidecar","world_size":4,"content":-99,"lineage":[17,2,40],"node":"n0"}')
    assert _head(path) == (4, -99, (17, 2, 40))
