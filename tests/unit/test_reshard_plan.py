"""The arithmetic and planning of a resharding restore, without processes: boxes agree
with DTensor's own, every new rank's pieces tile its box exactly once, both ends list the
same pieces, and the plan picks the newest complete step of whichever world saved it."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from incluster.errors import CheckpointError
from incluster.recovery.boxes import Layout, coord_of, local_slices, numel, rank_of
from incluster.recovery.plan import make_plan
from incluster.recovery.reshard_pieces import Maps, receiver_pieces, server_pieces, source_of
from incluster.topology import Topology

LAYOUTS = [
    ((7, 5), (3,), (("S", 0),)),
    ((7, 5), (4,), (("S", 1),)),
    ((10, 6), (2, 2), (("R",), ("S", 0))),  # HSDP: replicate x shard
    ((10, 6), (2, 3), (("S", 0), ("S", 1))),
    ((13, 4), (2, 3), (("S", 0), ("S", 0))),  # one dim cut twice, unevenly
    ((5,), (4,), (("S", 0),)),  # some ranks hold nothing
    ((6, 2), (3,), (("R",),)),
]


def _torch_placement(p):
    return Shard(p[1]) if p[0] == "S" else Replicate()


@pytest.mark.parametrize("shape,mesh,places", LAYOUTS)
def test_boxes_are_dtensors_own(shape, mesh, places):
    lay = Layout("float32", shape, mesh, places)
    for coord in itertools.product(*(range(n) for n in mesh)):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), [_torch_placement(p) for p in places])
        box = lay.box(coord)
        assert box[1] == tuple(local), (coord, box, local)
        if numel(box):
            assert box[0] == tuple(offset), (coord, box, offset)


def test_rank_coordinates_round_trip():
    for r in range(24):
        assert rank_of(coord_of(r, (2, 3, 4)), (2, 3, 4)) == r


def test_strided_and_partial_placements_are_refused_with_the_fix():
    node = {"global_shape": [4, 4], "mesh_shape": [2], "placements": [["SS", 0, 2]]}
    with pytest.raises(CheckpointError, match="incluster export"):
        Layout.of(node, "float32", "model/w")


def _reshard(old: Layout, new: Layout, nodes_new: list[int]) -> dict[int, torch.Tensor]:
    """Move a global tensor from the old cut to the new one with the piece lists alone,
    as both ends would; returns every new rank's local tensor."""
    full = torch.arange(numel(((0,) * len(old.global_shape), old.global_shape)), dtype=torch.float32)
    full = full.reshape(old.global_shape)
    old_world, new_world = old.world, new.world
    server_of = [o % new_world for o in range(old_world)]
    maps = Maps(server_of, nodes_new)
    held = {o: full[local_slices(old.box(coord_of(o, old.mesh_shape)), ((0,) * full.dim(), full.shape))] for o in range(old_world)}
    sent = set()
    for o in range(old_world):
        for r, p in server_pieces(o, {"w": old}, {"w": new}, maps):
            sent.add((r, p))
    out, got = {}, set()
    for r in range(new_world):
        box = new.box(coord_of(r, new.mesh_shape))
        local = torch.full(box[1], -1.0)
        covered = torch.zeros(box[1], dtype=torch.int32)
        for p in receiver_pieces(r, {"w": old}, {"w": box}, maps):
            got.add((r, p))
            src = held[p.owner][local_slices(p.box, old.box(coord_of(p.owner, old.mesh_shape)))]
            local[local_slices(p.box, box)] = src
            covered[local_slices(p.box, box)] += 1
        assert bool((covered == 1).all()), f"rank {r}: each element exactly once"
        out[r] = local
        assert torch.equal(local, full[local_slices(box, ((0,) * full.dim(), full.shape))])
    assert got == sent  # both ends list the same pieces
    return out


@pytest.mark.parametrize(
    "old,new",
    [
        (Layout("f", (7, 5), (4,), (("S", 0),)), Layout("f", (7, 5), (3,), (("S", 0),))),
        (Layout("f", (7, 5), (2,), (("S", 0),)), Layout("f", (7, 5), (4,), (("S", 1),))),
        (Layout("f", (10, 6), (2, 2), (("R",), ("S", 0))), Layout("f", (10, 6), (3,), (("S", 0),))),
        (Layout("f", (10, 6), (3,), (("S", 1),)), Layout("f", (10, 6), (2, 3), (("R",), ("S", 0)))),
        (Layout("f", (13, 4), (2, 3), (("S", 0), ("S", 0))), Layout("f", (13, 4), (5,), (("S", 0),))),
        (Layout("f", (6, 2), (3,), (("R",),)), Layout("f", (6, 2), (2,), (("S", 0),))),
    ],
)
def test_pieces_tile_every_new_box_and_both_ends_agree(old, new):
    _reshard(old, new, nodes_new=[r // 2 for r in range(new.world)])


def test_a_replicated_box_is_read_from_the_receivers_own_node():
    old = Layout("f", (8, 2), (2, 2), (("R",), ("S", 0)))  # old ranks 0,2 and 1,3 hold the same boxes
    server_of = [0, 1, 2, 2]  # old rank 3's copy is served on new rank 2's node
    maps = Maps(server_of, node_of=[0, 0, 1])
    pieces = receiver_pieces(2, {"w": old}, {"w": ((0, 0), (8, 2))}, maps)
    assert sorted(p.owner for p in pieces) == [2, 3]  # both halves from its own node's server


def test_own_values_rule():
    assert [source_of(r, 2, "same-rank") for r in range(4)] == [0, 1, 0, 1]
    assert [source_of(r, 4, "rank0") for r in range(3)] == [0, 0, 0]
    assert source_of(1, 4, "refuse") is None


def _holdings(world: int, step: int, nodes: list[str]) -> dict[str, list[tuple[int, int, int, int]]]:
    held: dict[str, list] = {n: [] for n in nodes}
    for r in range(world):
        held[nodes[r]].append((r, step, 100, world))
        held[nodes[(r + 1) % world]].append((r, step, 100, world))  # replica on the next node
    return held


def test_plan_reshards_the_newest_complete_step_when_the_world_shrank():
    held = _holdings(4, 30, ["n0", "n1", "n2", "n3"])
    del held["n3"]
    held["n0"].append((0, 40, 100, 3))  # a newer step of the new world, incomplete
    plan = make_plan(Topology.from_nodes(["n0", "n1", "n2"]), held)
    assert plan.step == 30 and plan.world == 4
    assert plan.server_of == [0, 1, 2, 0]  # old rank 3's replica is on n0
    assert all(p.world == 4 and p.source is None for p in plan.ranks)


def test_plan_prefers_its_own_world_and_excludes_bad_copies():
    held = _holdings(2, 30, ["n0", "n1"])
    held["n0"] += [(0, 30, 100, 3), (1, 30, 100, 3), (2, 30, 100, 3)]  # same step saved by 3 ranks too
    plan = make_plan(Topology.from_nodes(["n0", "n1", "n2"]), held)
    assert plan.step == 30 and plan.world == 3 and plan.server_of == []
    held = _holdings(2, 30, ["n0", "n1"])
    plan = make_plan(Topology.from_nodes(["n0", "n1", "n2"]), held, exclude={("n1", 1, 30)})
    assert plan.world == 2 and plan.server_of == [0, 0]  # old rank 1 only from n0 now


def test_a_resized_job_missing_a_shard_names_the_old_worlds_rank():
    """4 ranks saved step 21; old rank 2's shard is gone; the job restarts with 2 ranks.
    The lacking shard is old rank 2 of 4 - not this world's ranks 0 and 1, which no copy
    of an old-world step ever names."""
    from incluster.recovery.plan import choose_step

    holders = {(o, 21): [(f"n{o % 2}", 4)] for o in (0, 1, 3)}
    step, world, missing, saved_by = choose_step(holders, 2)
    assert step is None and missing == {21: [2]} and saved_by == {21: 4}
    holders[(0, 21)].append(("n1", 2))  # a copy this world saved too: its ranks are named
    assert choose_step(holders, 2)[2:] == ({21: [1]}, {})
