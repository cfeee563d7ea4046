"""Which copies a restore may combine: never two timelines' copies of one step, never a
step of a timeline that a later restore went back from (recovery/lineage.py)."""

from __future__ import annotations

import json

import pytest

from incluster.errors import CorruptCheckpointError
from incluster.format.checksum import compute
from incluster.format.sidecar import Sidecar, read_sidecar, write_sidecar
from incluster.recovery.lineage import NONE, current, parse

OLD = (100, 0, -1)  # a run that never loaded
NEW = (200, 1, 15)  # a later run that restored step 15


def _copy(owner: int, step: int, lin: tuple[int, int, int]) -> tuple[int, ...]:
    return (owner, step, 10, 2, 0, *lin)


def test_a_later_timeline_drops_the_steps_its_restore_went_back_past():
    held = {"A": [_copy(0, 15, OLD), _copy(1, 15, OLD), _copy(0, 18, NEW), _copy(1, 18, NEW)],
            "B": [_copy(0, 20, OLD), _copy(1, 20, OLD), _copy(1, 15, OLD)]}
    kept, dropped, chosen = current(held)
    assert sorted(dropped) == [("B", 0, 20), ("B", 1, 20)]
    assert {i[1] for items in kept.values() for i in items} == {15, 18}
    assert chosen == {15: OLD, 18: NEW}


def test_two_timelines_copies_of_one_step_are_never_combined():
    held = {"A": [_copy(0, 20, NEW), _copy(1, 20, NEW)], "B": [_copy(0, 20, OLD), _copy(1, 20, OLD)]}
    kept, dropped, chosen = current(held)
    assert kept == {"A": held["A"], "B": []} and chosen == {20: NEW}
    # a later run that did not load (no restore: it abandons nothing), at a step both saved
    later = (300, 0, -1)
    kept, _, chosen = current({"A": [_copy(0, 20, later)], "B": [_copy(1, 20, OLD), _copy(0, 10, OLD)]})
    assert chosen == {20: later, 10: OLD} and kept["B"] == [_copy(0, 10, OLD)]


def test_a_restore_that_found_nothing_abandons_every_older_step():
    fresh = (300, 1, -1)
    kept, dropped, _ = current({"A": [_copy(0, 5, fresh)], "B": [_copy(0, 40, OLD), _copy(0, 0, OLD)]})
    assert kept == {"A": [_copy(0, 5, fresh)], "B": []} and len(dropped) == 2


def test_copies_without_a_lineage_are_one_old_timeline():
    legacy = (0, 20, 10, 2, 0)  # written before copies recorded their timeline
    kept, dropped, chosen = current({"A": [legacy, (1, 20, 10, 2, 0)]})
    assert dropped == [] and chosen == {20: NONE}
    kept, dropped, _ = current({"A": [legacy], "B": [_copy(0, 18, NEW)]})
    assert dropped == [("A", 0, 20)]


def test_the_sidecar_records_its_lineage_and_refuses_a_malformed_one(tmp_path):
    sc = Sidecar(job="j", step=3, rank=0, world_size=1, node="n", shard="s", checksum=compute(b"abc"),
                 fingerprint="f", tree={"d": []}, lineage=NEW)
    path = str(tmp_path / "step.json")
    write_sidecar(path, sc)
    assert read_sidecar(path).lineage == NEW
    raw = json.load(open(path))
    assert list(raw)[:8][-1] == "lineage"  # in the head, read by restores from the first bytes
    legacy = {k: v for k, v in raw.items() if k not in ("lineage", "digest")} | {"version": 1}
    assert Sidecar.from_json(legacy, "x").lineage == NONE  # a record from before lineages
    raw = sc.to_json()
    raw["lineage"] = [1, -2, 3]
    with pytest.raises(CorruptCheckpointError, match="invalid lineage"):
        Sidecar.from_json(raw, "x")
    assert parse([1, 2]) == NONE and parse("x") == NONE and parse([5, 1, 3]) == (5, 1, 3)


def test_a_ring_whose_marker_a_neighbour_removed_forgets_the_step_too(local_dir):
    """Two ranks on a node: each un-commits the other's copy of the restored step number
    from another timeline. When the neighbour unlinked my marker first, my ring still
    thought it held the step and refused the heal ("step 20 is not newer than step 20")."""
    import os

    import torch

    import incluster
    from incluster.recovery.node import drop_other_timelines
    from incluster.staging.slots import sidecar_file

    with incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread") as ck:
        ck.save(20, {"w": torch.ones(8)}).wait()
        os.unlink(os.path.join(ck.ring.folder, sidecar_file(20)))  # the neighbour got there first
        drop_other_timelines(local_dir, "j", 20, NEW, ck.ring)
        assert 20 not in ck.ring.committed_steps()
        ck.save(21, {"w": torch.ones(8)}).wait()
