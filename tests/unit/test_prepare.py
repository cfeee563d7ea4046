"""Slots are made ready off the training path: ``prepare(state)`` before the first save,
and after every save the free slots are re-made for the shape just saved."""

from __future__ import annotations

import pytest
import torch

import incluster
from incluster.staging.slots import SlotState

from helpers import tiny_model, train


def _ckpt(local_dir, **kw):
    return incluster.Checkpointer(local_dir=local_dir, job="prep", writer="thread", **kw)


def _maps(ck):
    return {s.index: s.maps for s in ck.ring.slots}


def test_prepare_maps_every_slot_before_the_first_save(local_dir):
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    train(m, o, 1)
    state = {"model": m, "optim": o}
    with _ckpt(local_dir, keep=3) as ck:
        ck.prepare(state).result(30)
        assert len(ck.ring.slots) == 3
        assert all(s.buf is not None and s.size > 0 and s.maps == 1 for s in ck.ring.slots)
        before = _maps(ck)
        for step in range(1, 5):
            train(m, o, 1)
            ck.save(step, state).wait()
        assert _maps(ck) == before, "a save (re)mapped a slot that prepare() had made ready"


def test_prepare_before_the_first_optimizer_step_says_so(local_dir, caplog):
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    with _ckpt(local_dir) as ck, caplog.at_level("WARNING", logger="incluster"):
        ck.prepare({"model": m, "optim": o}).result(30)
        assert any("prepare() before the first optimizer step" in r.getMessage() for r in caplog.records)
        caplog.clear()
        train(m, o, 1)  # stepped since the Checkpointer exists: said no more (plain SGD keeps no state)
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        train(m, sgd, 1)
        ck.prepare({"model": m, "optim": o}).result(30)
        ck.prepare({"model": m, "optim": sgd}).result(30)
        assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_the_ram_a_rank_takes_is_said_once(local_dir, caplog):
    caplog.set_level("INFO", logger="incluster")
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    train(m, o, 1)
    state = {"model": m, "optim": o}
    with _ckpt(local_dir, keep=3) as ck:
        ck.prepare(state).result(30)  # three slots made ready
        for step in range(1, 3):
            ck.save(step, state).wait()
    said = [r.getMessage() for r in caplog.records if "this rank takes about" in r.getMessage()]
    assert len(said) == 1 and "3 slot files of its own" in said[0], said


def test_a_grown_state_remaps_free_slots_after_the_save_not_in_the_next(local_dir):
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    state = {"model": m, "optim": o}
    with _ckpt(local_dir) as ck:
        ck.prepare(state).result(30)  # before the first step: no optimizer state yet
        small = ck.ring.slots[0].size
        train(m, o, 1)  # AdamW's state appears: the shard grows
        ck.save(1, state).wait()  # remaps its own slot; the free one is re-made after it
        ck.wait_staged()
        ck._stage_pool.submit(lambda: None).result(30)  # the staging thread's work so far is done
        free = [s for s in ck.ring.slots if s.state is SlotState.FREE]
        assert free and all(s.size > small for s in free)
        maps = _maps(ck)
        train(m, o, 1)
        ck.save(2, state).wait()
        assert _maps(ck) == maps


def test_gpu_snapshot_option_is_validated():
    with pytest.raises(ValueError, match="gpu_snapshot"):
        incluster.Checkpointer(local_dir="/dev/shm/x", gpu_snapshot=-1)


def test_load_prepares_the_slots_so_the_first_save_maps_nothing(local_dir):
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    train(m, o, 1)
    state = {"model": m, "optim": o}
    with _ckpt(local_dir) as ck:
        ck.save(1, state).wait()
    with _ckpt(local_dir) as ck:  # a restart
        assert ck.load(state) == 1
        ck._stage_pool.submit(lambda: None).result(30)
        free = ck.ring.free_slots()  # the restored step's file is kept as it is
        assert len(ck.ring.slots) == ck.ring.keep and free and all(s.maps == 1 for s in free)
        maps = _maps(ck)
        train(m, o, 1)
        ck.save(2, state).wait()
        assert _maps(ck) == maps


def test_after_a_restart_with_every_slot_holding_a_step_the_one_the_next_save_takes_is_mapped_ahead(local_dir):
    """keep=2, two steps saved: after the restart no slot is free. The slot of the older
    step is mapped in the background (its bytes left alone: that step still verifies), so
    the first save maps nothing on its path."""
    from incluster.tiers.local import ShardReader

    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    train(m, o, 1)
    state = {"model": m, "optim": o}
    with _ckpt(local_dir, keep=2) as ck:
        for step in (1, 2):
            train(m, o, 1)
            ck.save(step, state).wait()
        folder = ck.folder
    with _ckpt(local_dir, keep=2) as ck:  # a restart
        assert ck.load(state) == 2
        ck._stage_pool.submit(lambda: None).result(30)
        assert not ck.ring.free_slots()
        ahead = {s.step: s for s in ck.ring.slots}
        assert ahead[1].buf is not None and ahead[1].maps == 1, "the slot the next save takes was not mapped"
        assert ahead[2].buf is None  # the newest step's slot is not the next save's
        with ShardReader(folder, 1):  # checksum verified: the mapping wrote nothing
            pass
        maps = _maps(ck)
        train(m, o, 1)
        ck.save(3, state).wait()
        assert _maps(ck) == maps, "the first save after the restart mapped its slot on its own path"
        with ShardReader(folder, 3), ShardReader(folder, 2):
            pass


def test_a_step_of_another_size_is_not_mapped_ahead(local_dir):
    """The next save's state is larger than the step the slot holds: that file is left
    exactly as it is (mapping it would mean resizing a committed step)."""
    import os

    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    state = {"model": m, "optim": o}
    with _ckpt(local_dir, keep=2) as ck:
        for step in (1, 2):
            ck.save(step, state).wait()  # no optimizer state yet: small shards
        folder = ck.folder
    train(m, o, 1)  # AdamW's state appears: this run's shard is larger
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}
    with _ckpt(local_dir, keep=2) as ck:
        ck.prepare(state).result(30)
        assert all(s.buf is None for s in ck.ring.slots)
        assert {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)} == sizes


def test_an_empty_load_does_not_touch_the_state(local_dir):
    """Nothing to restore: no state_dict() is called (torch's get_optimizer_state_dict steps
    a fresh optimizer once to create its state, which would change training)."""
    calls = []

    class Probe:
        def state_dict(self):
            calls.append(1)
            return {"w": torch.ones(2)}

        def load_state_dict(self, sd):
            pass

    with _ckpt(local_dir) as ck:
        assert ck.load({"probe": Probe()}) is None
        ck._stage_pool.submit(lambda: None).result(30)
    assert calls == []


def test_once_prepare_resolves_the_writer_process_has_started_and_no_save_is_given_up(local_dir, monkeypatch):
    # Saves made while the writer process starts may be given up for newer ones: a loop
    # that waited for prepare() has every save it makes from then on durable.
    from incluster.testing import FaultInjector

    # a start slower than making the slots (the suite's writers are forked ready, in ms)
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="writer-start", action="slow", seconds=2)
                                  .env().items())))
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    train(m, o, 1)
    state = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="prep", writer="process", keep=2) as ck:
        ck.prepare(state).result(120)
        assert ck._writer.started.done() and ck.writer_pid is not None
        handles = []
        for step in range(1, 7):  # faster than a save is durable: each waits for a slot instead
            train(m, o, 1)
            handles.append(ck.save(step, state))
        for h in handles:
            h.wait(60)  # raises a given-up save's error


def test_a_writer_start_that_fails_once_is_not_raised_by_prepare(local_dir, monkeypatch):
    # the successor starts at once and the saves land: prepare() is no place to fail a run
    from incluster.testing import FaultInjector

    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="writer-start", step=0).env().items())))
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    train(m, o, 1)
    state = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="prep", writer="process") as ck:
        ck.prepare(state).result(120)
        ck.save(1, state).wait(60)
