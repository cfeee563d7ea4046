"""Flatten/load of training state: every kind of value the API promises, and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from incluster.errors import CheckpointError
from incluster.state import flatten
from incluster.state_load import load_into

from helpers import assert_bitwise, clone_state, tiny_model, train


def _roundtrip(state, target, allow_pickle=False):
    flat = flatten(state, allow_pickle=allow_pickle)
    stored = {s.name: t.clone() for s, t in zip(flat.specs, flat.tensors)}
    load_into(target, flat.tree, stored.__getitem__, allow_pickle=allow_pickle)
    return flat


def test_model_and_adamw_round_trip_bitwise():
    m, m2 = tiny_model(0), tiny_model(9)
    o, o2 = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    train(m, o, 3)
    train(m2, o2, 1, seed=5)
    ref = clone_state(m, o)
    _roundtrip({"model": m, "optim": o}, {"model": m2, "optim": o2})
    assert_bitwise(m2, o2, ref)


def test_optimizer_that_never_stepped_is_rebuilt_and_continues_identically():
    m, m2 = tiny_model(0), tiny_model(7)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    train(m, o, 2)
    ref = clone_state(m, o)
    assert not o2.state  # lazy: no exp_avg yet
    _roundtrip({"model": m, "optim": o}, {"model": m2, "optim": o2})
    assert_bitwise(m2, o2, ref)
    train(m, o, 2, seed=3)
    train(m2, o2, 2, seed=3)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_sgd_without_momentum_state_round_trips():
    m, m2 = tiny_model(0), tiny_model(3)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    train(m, o, 2)
    _roundtrip({"model": m, "optim": o}, {"model": m2, "optim": o2})
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_loaded_in_place_keeps_parameter_identity():
    m, m2 = tiny_model(0), tiny_model(1)
    params = [p for p in m2.parameters()]
    ptrs = [p.data_ptr() for p in params]
    _roundtrip({"model": m}, {"model": m2})
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    assert all(a is b for a, b in zip(params, m2.parameters()))


def test_tied_weights_are_stored_once_and_stay_tied():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    a, b = Tied(), Tied()
    flat = _roundtrip({"model": a}, {"model": b})
    assert [s.name for s in flat.specs] == ["model/emb.weight"]
    assert torch.equal(b.emb.weight, a.emb.weight)
    assert b.head.weight is b.emb.weight


def test_json_leaves_and_containers_round_trip_exactly():
    extra = {
        "tokens": 123456789012345678901,
        "lr": 0.1 + 0.2,
        "nan": float("nan"),
        "inf": float("-inf"),
        "name": "run/7",
        "flag": True,
        "none": None,
        "pair": (1, "two"),
        "nested": {"a": [1, 2, {"b": torch.arange(3)}], 5: "int key"},
    }
    target = {"extra": {"stale": 1}}
    _roundtrip({"extra": extra}, target)
    got = target["extra"]
    assert got["tokens"] == extra["tokens"] and got["lr"] == extra["lr"]
    assert math.isnan(got["nan"]) and got["inf"] == float("-inf")
    assert got["pair"] == (1, "two") and isinstance(got["pair"], tuple)
    assert got["flag"] is True and got["none"] is None and got["name"] == "run/7"
    assert torch.equal(got["nested"]["a"][2]["b"], torch.arange(3))
    assert got["nested"][5] == "int key" and "stale" not in got


def test_keys_with_slashes_do_not_collide():
    state = {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    flat = flatten(state)
    assert len({s.name for s in flat.specs}) == 2


class Loader:
    """A Stateful that is neither Module nor Optimizer (e.g. a data loader)."""

    def __init__(self, pos=0):
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def test_stateful_objects_are_saved_through_state_dict():
    src, dst = Loader(41), Loader(0)
    _roundtrip({"loader": src}, {"loader": dst})
    assert dst.pos == 41


def test_unsupported_object_is_refused_naming_path_and_fix():
    with pytest.raises(CheckpointError, match=r"extra/cb.*allow_pickle=True"):
        flatten({"extra": {"cb": object()}})
    with pytest.raises(CheckpointError, match="dict of named parts"):
        flatten([torch.ones(1)])  # type: ignore[arg-type]


def test_pickle_only_when_allowed_on_both_sides():
    from fractions import Fraction

    state = {"extra": {"frac": Fraction(1, 3)}}
    flat = flatten(state, allow_pickle=True)
    stored = {s.name: t.clone() for s, t in zip(flat.specs, flat.tensors)}
    with pytest.raises(CheckpointError, match="can run code"):
        load_into({"extra": {}}, flat.tree, stored.__getitem__)
    target = {"extra": {}}
    load_into(target, flat.tree, stored.__getitem__, allow_pickle=True)
    assert target["extra"]["frac"] == Fraction(1, 3)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(CheckpointError, match="same configuration"):
        _roundtrip({"w": torch.ones(3)}, {"w": torch.ones(4)})


def test_missing_part_in_checkpoint_is_a_clear_error():
    with pytest.raises(CheckpointError, match="no entry for"):
        _roundtrip({"model": tiny_model()}, {"model": tiny_model(), "other": torch.ones(1)})


def test_dtensor_shard_saved_with_placement_and_loaded_in_place(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).reshape(4, 3)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        flat = flatten({"w": dt})
        node = flat.tree["d"][0][1]
        assert node["global_shape"] == [4, 3] and node["placements"] == [["S", 0]]
        assert node["global_offset"] == [0, 0]
        target = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
        stored = {s.name: t.clone() for s, t in zip(flat.specs, flat.tensors)}
        load_into({"w": target}, flat.tree, stored.__getitem__)
        assert torch.equal(target.full_tensor(), full)
        with pytest.raises(CheckpointError, match="incluster export"):
            load_into({"w": torch.zeros(4, 3)}, flat.tree, stored.__getitem__)
    finally:
        dist.destroy_process_group()


def test_a_sharded_tensor_is_refused_with_the_fix(tmp_path):
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.metadata import ShardMetadata

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        local = [Shard(torch.ones(4, 2), ShardMetadata([0, 0], [4, 2], "rank:0/cpu"))]
        st = ShardedTensor._init_from_local_shards(local, [4, 2])
        with pytest.raises(CheckpointError, match="device_mesh"):
            flatten({"model": {"w": st}})

        class Sharded:  # how a sharded model's state reaches the Checkpointer
            def state_dict(self):
                return {"w": st}

            def load_state_dict(self, sd):
                pass

        with pytest.raises(CheckpointError, match=r"model/w: a ShardedTensor"):
            flatten({"model": Sharded()})
    finally:
        dist.destroy_process_group()


def test_a_plain_dataloader_is_refused_with_the_stateful_replacement_named():
    import torch.utils.data as tud

    from incluster.state import flatten

    loader = tud.DataLoader(tud.TensorDataset(torch.arange(10.0)), batch_size=2)
    with pytest.raises(CheckpointError, match=r"loader: a plain torch DataLoader has no state.*StatefulDataLoader"):
        flatten({"loader": loader, "w": torch.ones(2)})


def test_a_saved_stateful_object_loaded_into_a_plain_value_names_both(local_dir):
    import incluster

    class Counter:
        def __init__(self):
            self.n = 3

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    with incluster.Checkpointer(local_dir=local_dir, job="s", writer="thread") as ck:
        ck.save(1, {"loader": Counter(), "w": torch.ones(2)}).wait()
    with incluster.Checkpointer(local_dir=local_dir, job="s", writer="thread") as ck:
        with pytest.raises(CheckpointError, match=r"loader: the checkpoint holds the state of an object with "
                                                  r"state_dict\(\).*the live state has a builtins.list"):
            ck.load({"loader": [1, 2], "w": torch.zeros(2)})


def test_what_a_module_saves_is_what_its_own_state_dict_and_hooks_say():
    """save() takes a module's tensors without a detach() each where nothing could tell the
    difference; a state_dict of the module's own (without keep_vars), a post-hook or a
    _save_to_state_dict override still decides what is saved."""

    class Old(torch.nn.Module):  # an override without keep_vars
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(4.0))

        def state_dict(self):  # type: ignore[override]
            return {"w_times_two": self.w.detach() * 2}

    class Quantish(torch.nn.Linear):  # saves a transformed weight
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            destination[prefix + "weight"] = (self.weight.detach() * 4).round()

    class Packed(torch.nn.Linear):  # a child's own state_dict, which branches on keep_vars
        def state_dict(self, *args, destination=None, prefix="", keep_vars=False):  # type: ignore[override]
            out = {} if destination is None else destination
            if keep_vars:
                out[prefix + "weight"] = self.weight
            else:
                out[prefix + "weight_q"] = (self.weight.detach() * 8).round()
            return out

    hooked = torch.nn.Linear(2, 2)
    hooked.register_state_dict_post_hook(lambda mod, sd, prefix, meta: sd.__setitem__(prefix + "extra", torch.ones(3)))
    q = torch.nn.Sequential(Quantish(2, 2, bias=False), torch.nn.ReLU())
    packed = torch.nn.Sequential(Packed(2, 2))
    flat = flatten({"old": Old(), "hooked": hooked, "q": q, "plain": torch.nn.Linear(2, 2), "packed": packed})
    got = {s.name: t for s, t in zip(flat.specs, flat.tensors)}
    assert torch.equal(got["old/w_times_two"], torch.arange(4.0) * 2)
    assert torch.equal(got["hooked/extra"], torch.ones(3))
    assert torch.equal(got["q/0.weight"], (q[0].weight.detach() * 4).round())
    assert set(got) == {"old/w_times_two", "hooked/weight", "hooked/bias", "hooked/extra", "q/0.weight",
                        "plain/weight", "plain/bias", "packed/0.weight_q"}
    assert torch.equal(got["packed/0.weight_q"], (packed[0].weight.detach() * 8).round())


def test_a_lazy_module_before_its_first_forward_is_refused_in_save_with_the_fix(local_dir):
    import incluster

    with incluster.Checkpointer(local_dir=local_dir, job="lazy", writer="thread") as ck:
        m = torch.nn.Sequential(torch.nn.LazyLinear(4))
        with pytest.raises(CheckpointError, match="0.weight: an uninitialized parameter.*forward pass"):
            ck.save(1, {"m": m})
        m(torch.ones(2, 3))  # materialized: saved as usual
        ck.save(2, {"m": m}).wait()
