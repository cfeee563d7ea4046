"""The staging thread's flatten for a structure seen before (flat_fast) gives exactly what
the full flatten gives - tensors, names, specs, byte count and tree, with this save's own
values - for every kind of state, and never trusts a structure it has not checked."""

from __future__ import annotations

import enum
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import incluster
from incluster.errors import CheckpointError
from incluster.flat_fast import FastFlattener
from incluster.state import flatten_snapshot, snapshot

from helpers import tiny_model, train


def _check(ff: FastFlattener, snap) -> None:
    """``ff`` flattens ``snap`` as flatten_snapshot does."""
    got, ref = ff.flatten(snap), flatten_snapshot(snap)
    assert got.specs == ref.specs
    assert got.tree == ref.tree
    assert got.nbytes == ref.nbytes
    assert len(got.tensors) == len(ref.tensors)
    assert all(a is b for a, b in zip(got.tensors, ref.tensors))


def _model_state(unguarded: bool = False):
    m = tiny_model(0)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, o, 2)
    state = {"model": m, "optim": o, "extra": {"step": 7, "loss": 0.25, "rng": torch.get_rng_state()}}
    guarded = (lambda opts: set()) if unguarded else None  # nothing guarded: every tensor cloned at save()
    return m, o, state, guarded


@pytest.mark.parametrize("unguarded", [False, True], ids=["guarded", "cloned-at-save"])
def test_a_model_and_optimizer_flatten_alike_and_the_second_save_is_a_hit(unguarded):
    m, o, state, guarded = _model_state(unguarded)
    ff = FastFlattener()
    for _ in range(3):
        snap, _, _ = snapshot(state, guarded=guarded)
        _check(ff, snap)
    assert (ff.misses, ff.hits, ff.slow) == (1, 2, 0)


def test_a_hit_carries_this_saves_values_not_the_first_ones():
    m, o, state, _ = _model_state()
    ff = FastFlattener()
    ff.flatten(snapshot(state)[0])
    o.param_groups[0]["lr"] = 0.5
    state["extra"]["loss"] = float("nan")
    state["extra"]["step"] = 8
    snap, _, _ = snapshot(state)
    got = ff.flatten(snap)
    assert ff.hits == 1
    assert got.tree == flatten_snapshot(snap).tree
    assert "0.5" in repr(got.tree) and "'nan'" in repr(got.tree)
    got.tree["d"].clear()  # a tree handed out is the save's own: the next one is whole
    _check(ff, snapshot(state)[0])


def test_tied_weights_and_views_of_one_storage_are_stored_once_each_view():
    base = torch.randn(6, 4)
    emb = torch.nn.Embedding(6, 4)
    head = torch.nn.Linear(4, 6, bias=False)
    head.weight = emb.weight  # tied
    state = {"emb": emb, "head": head, "a": base, "a_again": base, "rows": base[2:], "flat": base.view(-1),
             "t": base.t()}
    ff = FastFlattener()
    for _ in range(2):
        _check(ff, snapshot(state)[0])
    assert ff.hits == 1
    names = [s.name for s in ff.flatten(snapshot(state)[0]).specs]
    assert "a_again" not in names and {"a", "rows", "flat", "t"} <= set(names)


def test_a_change_of_tying_or_keys_with_the_same_shapes_is_a_new_structure():
    x, y = torch.randn(3), torch.randn(3)
    ff = FastFlattener()
    for state in ({"a": x, "b": x}, {"a": x, "b": y}, {"a": x, "c": y}, {"a": {"l": x, 3: y}}, {"a": ["l", 3]},
                  {"a": [x, y]}, {"a": (x, y)}, {"a": {"0": x}}, {"a": {0: x}}):
        _check(ff, snapshot(state)[0])
        assert ff.hits == 0
    _check(ff, snapshot({"a": {0: x}})[0])
    assert ff.hits == 1


def test_containers_and_scalars_of_every_kind():
    state = {"n": {1: [True, None, "s", 2, -0.0, math.inf, -math.inf, math.nan], "t": (1.5, (), [], {})},
             "e": torch.empty(0), "i": torch.arange(3), "b": torch.zeros(2, dtype=torch.bool)}
    ff = FastFlattener()
    for _ in range(2):
        _check(ff, snapshot(state)[0])
    assert ff.hits == 1


class Color(enum.IntEnum):
    RED = 1


class Opaque:
    def __init__(self) -> None:
        self.v = [1, 2]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.v == self.v


@pytest.mark.parametrize("value", [{Color.RED: torch.ones(2)}, {"x": np.float64(1.5)}, {"x": Color.RED}],
                         ids=["enum-key", "numpy-float", "enum-value"])
def test_values_the_fast_walk_does_not_know_go_the_slow_way(value):
    """(save()'s snapshot stores these as plain values; a flatten of them as they are
    goes the slow way, and after a few such in a row the fast walk is not tried.)"""
    ff = FastFlattener()
    for _ in range(4):
        _check(ff, value)
    assert ff.hits == 0 and ff.slow == 4
    assert ff.hits + ff.misses == 0


def test_an_object_to_pickle_goes_the_slow_way():
    ff = FastFlattener(allow_pickle=True)
    state = {"w": torch.ones(3), "o": Opaque()}
    for _ in range(2):
        snap = snapshot(state, allow_pickle=True)[0]
        got, ref = ff.flatten(snap), flatten_snapshot(snap, allow_pickle=True)
        assert got.specs == ref.specs and got.tree == ref.tree
        assert torch.equal(got.tensors[1], ref.tensors[1])  # the pickled bytes
    assert ff.slow == 2 and ff.hits == 0


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.randn(4, 4).to_sparse(), "sparse"),
    (lambda: torch.empty(3, device="meta"), "meta device"),
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "nested"),
], ids=["sparse", "meta", "nested"])
def test_a_value_refused_is_refused_with_the_slow_walks_words_even_after_a_hit(bad, match):
    ff = FastFlattener()
    good = {"w": torch.randn(3), "x": torch.empty(3)}
    ff.flatten(good)
    ff.flatten(good)
    assert ff.hits == 1
    with pytest.raises(CheckpointError, match=match):
        ff.flatten({"w": torch.randn(3), "x": bad()})


def test_a_dtensor_and_a_modules_dtensor_parameter_flatten_alike(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        lin = torch.nn.Linear(4, 3)
        lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
        state = {"w": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Replicate()]), "lin": lin}
        ff = FastFlattener()
        for _ in range(3):
            _check(ff, snapshot(state)[0])
        assert ff.hits == 2
        got = ff.flatten(snapshot(state)[0])
        got.tree["d"][0][1]["placements"][0][0] = "X"  # a tree's placements are its own
        _check(ff, snapshot(state)[0])
    finally:
        dist.destroy_process_group()


_POOL = [torch.randn(4, 3), torch.randn(12), torch.randn(4, 3), torch.zeros(2, dtype=torch.float16)]
_VIEWS = [lambda i: _POOL[i % 4], lambda i: _POOL[i % 4][1:], lambda i: _POOL[i % 4].view(-1),
          lambda i: _POOL[i % 4].reshape(-1)[:2]]
_leaves = st.one_of(
    st.builds(lambda i, j: _VIEWS[j](i), st.integers(0, 3), st.integers(0, 3)),
    st.integers(-3, 3), st.booleans(), st.none(), st.sampled_from(["a", "b"]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_states = st.recursive(
    _leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.lists(kids, max_size=3).map(tuple),
                           st.dictionaries(st.one_of(st.sampled_from(["a", "b", "l", "d"]), st.integers(0, 3)),
                                           kids, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["x", "y"]), _states, min_size=1), min_size=1, max_size=3))
def test_any_sequence_of_states_flattens_as_the_full_flatten_does(states):
    ff = FastFlattener()
    for state in states + states:
        try:
            ref = flatten_snapshot(snapshot(state)[0])
        except CheckpointError as exc:  # two values with one name: refused alike
            with pytest.raises(CheckpointError, match=str(exc)[:20].replace("(", r"\(").replace("[", r"\[")):
                ff.flatten(snapshot(state)[0])
            continue
        del ref
        _check(ff, snapshot(state)[0])


def test_saves_of_one_structure_take_the_fast_path_and_load_back_their_own_values(local_dir):
    m = tiny_model(0)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with incluster.Checkpointer(local_dir=local_dir, job="fast", replicas=0, writer="thread") as ck:
        for step in (1, 2, 3):
            train(m, o, 1, seed=step)
            o.param_groups[0]["lr"] = step / 10
            ck.save(step, {"model": m, "optim": o, "step": step}).wait()
        assert ck._stager.flattener.hits == 2
        want = {k: v.clone() for k, v in m.state_dict().items()}
    m2 = tiny_model(5)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    got = {"model": m2, "optim": o2, "step": 0}
    with incluster.Checkpointer(local_dir=local_dir, job="fast", replicas=0, writer="thread") as ck:
        assert ck.load(got) == 3
    assert got["step"] == 3 and o2.param_groups[0]["lr"] == pytest.approx(0.3)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, want[k]), k
