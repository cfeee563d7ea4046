"""Hypothesis-driven hostile records: sidecars and state trees mutated at random are
either refused with a CorruptCheckpointError or describe a record every reader can walk.
Nothing else may escape (no KeyError, TypeError, RecursionError...)."""

from __future__ import annotations

import json

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from incluster.errors import CorruptCheckpointError
from incluster.format.checksum import ALGO
from incluster.format.sidecar import Sidecar
from incluster.format.tree import check_tree
from incluster.state import flatten

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
    max_leaves=12,
)


def _good_sidecar() -> dict:
    state = {"m": torch.nn.Linear(3, 2).state_dict(), "extra": {"step": 3, "lr": 0.1, "tags": ["a", 1]}}
    flat = flatten(state)
    return {
        "format": "incluster-sidecar", "version": 1, "job": "j", "step": 3, "rank": 0, "world_size": 2,
        "node": "n", "shard": "step-000000000003.safetensors",
        "checksum": {"algo": ALGO, "size": 10, "chunk": 64 << 20, "digests": ["0" * 16]},
        "fingerprint": "f", "tree": flat.tree, "created": 1.0, "extra": {},
    }


GOOD = _good_sidecar()


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


PATHS = list(_paths(GOOD))[1:]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_sidecars_are_refused_or_walkable(data):
    obj = json.loads(json.dumps(GOOD))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(PATHS))
        node = obj
        try:
            for k in path[:-1]:
                node = node[k]
            if data.draw(st.booleans()) and isinstance(node, dict):
                node.pop(path[-1], None)
            else:
                node[path[-1]] = data.draw(JSON)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation changed the shape under this path
    try:
        sc = Sidecar.from_json(obj, "mutated")
    except CorruptCheckpointError:
        return
    assert type(sc.step) is int and 0 <= sc.rank < sc.world_size
    assert "/" not in sc.shard and not sc.shard.startswith(".")
    check_tree(sc.tree, "again")  # the tree a reader will walk passed the same checks


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_arbitrary_json_as_a_tree_is_refused_or_well_formed(tree):
    try:
        check_tree(tree, "t")
    except CorruptCheckpointError:
        return
    assert isinstance(tree, dict) and isinstance(tree["d"], list)


def test_the_unmutated_record_passes():
    assert Sidecar.from_json(json.loads(json.dumps(GOOD)), "good").step == 3
    check_tree(GOOD["tree"], "good")
