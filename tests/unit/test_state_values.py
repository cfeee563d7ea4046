"""Values at the edges of what a state may hold: saved and loaded back as they were, or
refused by save() itself (never by the next save(), never as a step no load can read)."""

from __future__ import annotations

import collections
import enum
import re

import pytest
import torch

import incluster
from incluster import state as state_mod
from incluster.errors import CheckpointError


class Phase(enum.IntEnum):  # defined in the trainer's script: the writer process cannot import it
    WARMUP = 1
    MAIN = 2


class Mode(enum.StrEnum):
    TRAIN = "train"


Pos = collections.namedtuple("Pos", "epoch batch")


def _ckpt(local_dir: str, writer: str = "thread") -> incluster.Checkpointer:
    return incluster.Checkpointer(local_dir=local_dir, job="values", replicas=0, writer=writer)


def test_enum_members_are_saved_as_their_values_and_come_back_as_members(local_dir):
    """An IntEnum in the state killed the writer process at every save (it could not
    unpickle the trainer's class): three restarts, then the Checkpointer was unusable."""
    with _ckpt(local_dir, writer="process") as ck:
        state = {"extra": {"phase": Phase.MAIN, "mode": Mode.TRAIN, "by_phase": {Phase.WARMUP: torch.ones(2)},
                           "pos": Pos(3, 7), "w": torch.arange(4.0)}}
        for step in (1, 2):
            ck.save(step, state).wait(60)
        state["extra"] = {"phase": Phase.WARMUP, "mode": Mode.TRAIN, "by_phase": {Phase.WARMUP: torch.zeros(2)},
                          "pos": Pos(0, 0), "w": torch.zeros(4)}
        assert ck.load(state) == 2
    extra = state["extra"]
    assert extra["phase"] is Phase.MAIN and extra["mode"] is Mode.TRAIN
    assert type(extra["pos"]) is Pos and extra["pos"].batch == 7  # a namedtuple stays one
    assert torch.equal(extra["by_phase"][1], torch.ones(2)) and torch.equal(extra["w"], torch.arange(4.0))


class Color(enum.Enum):  # a plain Enum: its members are not ints or strs themselves
    RED = 1
    BLUE = "blue"


def test_plain_enum_members_numpy_scalars_and_a_numpy_step_round_trip(local_dir):
    """A plain Enum member and a numpy scalar were refused ("cannot checkpoint a numpy.float32")
    and a numpy step counter too ("step must be a non-negative int")."""
    import numpy as np

    with _ckpt(local_dir, writer="process") as ck:
        state = {"extra": {"c": Color.BLUE, "lr": np.float32(0.1), "n": np.int64(2**40), "on": np.bool_(True),
                           "loss": 2.7}}
        ck.save(np.int64(3), state).wait(60)
        state["extra"] = {"c": Color.RED, "lr": np.float32(0), "n": np.int64(0), "on": np.bool_(False),
                          "loss": np.int64(0)}
        assert ck.load(state) == 3
        with pytest.raises(CheckpointError, match="of type Color cannot be stored; use str or int keys"):
            ck.save(4, {"extra": {"by": {Color.RED: torch.ones(2)}}})  # load() could not find the live key
    extra = state["extra"]
    assert extra["c"] is Color.BLUE
    assert extra["loss"] == 2.7 and type(extra["loss"]) is float  # never cut to the live value's int type
    assert type(extra["lr"]) is np.float32 and extra["lr"] == np.float32(0.1)
    assert type(extra["n"]) is np.int64 and extra["n"] == 2**40 and extra["on"] is np.True_
    with _ckpt(local_dir) as ck:
        for bad in (np.float64(4.0), np.True_, torch.tensor(True)):
            with pytest.raises(ValueError, match="step must be a non-negative int"):
                ck.save(bad, {"extra": {"w": torch.ones(2)}})


@pytest.mark.parametrize("key, said", [((0, 1), "dict key (0, 1) of type tuple"),
                                       (float("nan"), "dict key nan cannot be stored")])
def test_a_key_that_cannot_be_stored_is_refused_by_save_itself(local_dir, key, said):
    """Refused on the staging thread before, the error came out of the next valid save(),
    which then did not save its own step."""
    with _ckpt(local_dir) as ck:
        with pytest.raises(CheckpointError, match=re.escape(f"extra/seen: {said}")):
            ck.save(1, {"extra": {"w": torch.ones(2), "seen": {key: 5}}})
        ck.save(2, {"extra": {"w": torch.ones(2)}}).wait(60)


class Tag(int):  # an int subclass that is not equal to its value as a key
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


def test_a_key_stored_as_its_plain_value_beside_that_value_is_refused_not_merged(local_dir):
    with _ckpt(local_dir) as ck:
        with pytest.raises(CheckpointError, match="dict key 1 appears twice"):
            ck.save(1, {"extra": {Tag(1): torch.ones(2), 1: torch.zeros(2)}})


def test_state_deeper_than_a_reader_takes_is_refused_by_save(local_dir):
    """A state nested 198 dicts deep was saved and reported durable; load() then called the
    copy "not written by incluster" and set it aside: the checkpoint was lost."""
    deep: dict = {"leaf": torch.ones(1)}
    for _ in range(state_mod.MAX_SAVE_DEPTH + 5):
        deep = {"n": deep}
    with _ckpt(local_dir, writer="process") as ck:
        with pytest.raises(CheckpointError, match="nested deeper than 100 levels"):
            ck.save(1, {"extra": deep})
        ok: dict = {"leaf": torch.ones(1)}
        for _ in range(state_mod.MAX_SAVE_DEPTH - 3):  # the deepest save() takes: written and read back
            ok = {"n": ok}
        ck.save(2, {"extra": ok}).wait(60)
        assert ck.load({"extra": ok}) == 2


def test_more_values_than_a_reader_takes_are_refused(local_dir, monkeypatch):
    """A 10,000,000-element list (a sampler's permutation) was saved and then unloadable."""
    monkeypatch.setattr(state_mod, "MAX_NODES", 1000)
    with _ckpt(local_dir) as ck:
        with pytest.raises(CheckpointError, match="keep long lists of numbers as tensors"):
            ck.save(1, {"extra": {"perm": list(range(2000))}})
    with pytest.raises(CheckpointError, match="more than 1,000 values \\(tensors, lists"):
        state_mod.flatten({"extra": [list(range(600)), list(range(600))]})  # many lists, each short


def test_a_record_over_the_readers_cap_fails_its_step(local_dir, monkeypatch):
    from incluster.format import sidecar

    monkeypatch.setattr(sidecar, "MAX_SIDECAR_BYTES", 20_000)
    with _ckpt(local_dir) as ck:
        with pytest.raises(CheckpointError, match="over the 20,000 a reader takes"):
            ck.save(1, {"extra": {"note": "x" * 50_000, "w": torch.ones(2)}}).wait(60)
        ck.save(2, {"extra": {"note": "short", "w": torch.ones(2)}}).wait(60)
        assert ck.load({"extra": {"note": "", "w": torch.zeros(2)}}) == 2


def test_an_expanded_tensor_round_trips_into_an_expanded_live_tensor(local_dir):
    """load() failed in copy_ (one memory location for many elements) after other live
    tensors had been overwritten, naming no path."""
    with _ckpt(local_dir) as ck:
        state = {"extra": {"a": torch.ones(3), "e": torch.arange(3.0).reshape(1, 3).expand(4, 3)}}
        ck.save(1, state).wait(60)
        state["extra"]["a"].fill_(-1)
        state["extra"]["e"] = torch.zeros(1, 3).expand(4, 3)
        assert ck.load(state) == 1
        assert torch.equal(state["extra"]["e"], torch.arange(3.0).reshape(1, 3).expand(4, 3))
        assert state["extra"]["e"].stride() == (0, 1) and torch.equal(state["extra"]["a"], torch.ones(3))
        state["extra"]["e"] = torch.zeros(4, 3)[:, :1].expand(4, 3)  # one value per row: the saved rows differ
        ck.save(2, {"extra": {"a": torch.ones(3), "e": torch.arange(12.0).reshape(4, 3)}}).wait(60)
        with pytest.raises(CheckpointError, match="extra/e: the live tensor is expanded along dimension 1"):
            ck.load(state)


@pytest.mark.parametrize("make, said", [
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "a nested tensor cannot be stored"),
    (lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8), "save t.int_repr()"),
])
def test_tensors_a_shard_cannot_hold_are_refused_with_their_fix(local_dir, make, said):
    with _ckpt(local_dir) as ck:
        with pytest.raises(CheckpointError, match=f"extra/x: .*{said}"):
            ck.save(1, {"extra": {"x": make()}})


def test_live_dict_keys_the_checkpoint_lacks_are_named_when_load_drops_them(local_dir, caplog):
    """A counter added to a nested dict since the save vanished at load() without a word."""
    with _ckpt(local_dir) as ck:
        ck.save(1, {"extra": {"stats": {"seen": 3}, "w": torch.ones(2)}}).wait(60)
        live = {"extra": {"stats": {"seen": 0, "skipped": 0}, "w": torch.zeros(2)}}
        with caplog.at_level("WARNING", logger="incluster"):
            assert ck.load(live) == 1
    assert live["extra"]["stats"] == {"seen": 3}
    said = [r.getMessage() for r in caplog.records if "extra/stats" in r.getMessage()]
    assert said and "the live dict has key(s) ['skipped'] that the checkpoint does not" in said[0], said
    assert not [r for r in caplog.records if "'state'" in r.getMessage()]  # nothing about objects' own dicts


class Wrap:  # an object with state_dict()/load_state_dict() around another value
    def __init__(self, inner: object) -> None:
        self.inner = inner

    def state_dict(self) -> dict:
        return {"x": self.inner}

    def load_state_dict(self, sd: dict) -> None:
        self.inner = sd["x"]


def test_what_save_refuses_is_always_a_checkpoint_error(local_dir, monkeypatch):
    """save() refuses at once where the staging walk would; where the two counted apart,
    the library's private marker exception reached the user instead of a CheckpointError."""
    deep: object = torch.ones(1)
    for _ in range(60):  # each object is two levels of the record: its node and its state dict
        deep = Wrap(deep)
    merged = Wrap({Tag(1): torch.ones(1), 1: torch.zeros(1)})
    monkeypatch.setattr(state_mod, "MAX_NODES", 8)
    with _ckpt(local_dir) as ck:
        for state in ({"s": deep}, {"s": merged}, {"l": [torch.ones(1)] * 8}):
            with pytest.raises(CheckpointError):
                ck.save(1, state)


def test_a_refusal_names_the_value_at_fault_not_a_deep_module_beside_it(local_dir):
    """A module at depth 99 is within what save() takes; when another value was refused, the
    walk that names it stopped at the module's state dict and blamed the depth. With
    allow_pickle, an object pickle cannot take made save() raise pickle's TypeError."""
    import threading

    deep: dict = {"m": torch.nn.Linear(2, 2)}
    for _ in range(state_mod.MAX_SAVE_DEPTH - 3):  # the module at depth 99
        deep = {"n": deep}
    with _ckpt(local_dir) as ck:
        with pytest.raises(CheckpointError, match=r"z: cannot checkpoint a builtins.object"):
            ck.save(1, {"extra": deep, "z": object()})
        ck.save(2, {"extra": deep}).wait(60)
    with incluster.Checkpointer(local_dir=local_dir, job="pickled", replicas=0, writer="thread",
                                allow_pickle=True) as ck:
        with pytest.raises(CheckpointError, match=r"lock: cannot pickle a _thread.lock"):
            ck.save(1, {"extra": {"lock": threading.Lock(), "c": torch.ones(2, dtype=torch.complex64)}})


def test_a_module_tensor_a_shard_cannot_hold_is_refused_by_save_itself(local_dir):
    """A module on the meta device was refused on the staging thread, so the next save()
    raised it and lost its own step; a module with a sparse buffer made save() raise
    torch's "Cannot access data pointer". A sparse buffer the state dict leaves out is no
    obstacle."""
    meta = torch.nn.Linear(2, 2, device="meta")
    sparse = torch.nn.Linear(2, 2)
    sparse.register_buffer("adj", torch.eye(2).to_sparse())
    hooked = torch.nn.Linear(2, 2, device="meta")  # a state-dict hook: the module's own state_dict() runs
    hooked._register_state_dict_hook(lambda module, sd, prefix, local: sd)
    with _ckpt(local_dir) as ck:
        for step, (model, said) in enumerate([(meta, "m/weight: a tensor on the meta device"),
                                              (hooked, "m/weight: a tensor on the meta device"),
                                              (sparse, "m/adj: a torch.sparse_coo tensor cannot be stored")], 1):
            with pytest.raises(CheckpointError, match=re.escape(said)):
                ck.save(step, {"m": model})
        kept = torch.nn.Linear(2, 2)
        kept.register_buffer("adj", torch.eye(2).to_sparse(), persistent=False)
        ck.save(4, {"m": kept}).wait(60)
        weight = kept.weight.detach().clone()
        with torch.no_grad():
            kept.weight.zero_()
        assert ck.load({"m": kept}) == 4 and torch.equal(kept.weight, weight)
