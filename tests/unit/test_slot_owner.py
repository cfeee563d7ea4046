"""The slot ring is the one owner of slot state: a failed save frees its slot in one
locked transition (no save can take it half way), and a restore never deletes files
another rank's ring owns."""

from __future__ import annotations

import os
import threading
import time

import pytest

from incluster.errors import CheckpointError
from incluster.recovery.node import abandon_newer
from incluster.staging.slots import SlotRing, SlotState, sidecar_file, step_file


def test_a_failed_commit_frees_its_slot_atomically_while_a_save_waits(local_dir, monkeypatch):
    ring = SlotRing(os.path.join(local_dir, "rank-00000"), keep=2)
    a = ring.acquire(1, 5)
    ring.prepare(a, 4096)
    os.replace(a.path, os.path.join(ring.folder, step_file(1)))
    open(os.path.join(ring.folder, sidecar_file(1)), "w").close()
    ring.mark_committed(a, 1, os.path.join(ring.folder, step_file(1)))
    b = ring.acquire(2, 5)  # the ring is full: a third save must wait for a slot
    ring.prepare(b, 4096)

    real_replace = os.replace

    def slow_replace(src, dst):  # widen the failure's window: a taker would slip in here
        time.sleep(0.3)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", slow_replace)
    taken: list = []
    waiter = threading.Thread(target=lambda: taken.append(ring.acquire(3, 5)))
    ring.set_global(1)  # step 1 complete everywhere, step 2 still in flight: slot a may not go yet
    waiter.start()
    time.sleep(0.1)
    assert not taken, "no slot is free yet"
    # Step 1 turns out not to be committed everywhere (its outcome failed): free slot a.
    ring.fail(a, 1)
    waiter.join(5)
    assert taken and taken[0] is a
    assert a.state is SlotState.STAGING and a.step == 3, "the failure must not free a slot a new save took"
    assert a.path == os.path.join(ring.folder, ".staging-0") and os.path.exists(a.path)
    assert not os.path.exists(os.path.join(ring.folder, sidecar_file(1)))
    ring.fail(a, 1)  # a late, repeated report of the old failure leaves the new save alone
    assert a.state is SlotState.STAGING and a.step == 3
    ring.close()


def test_abandoning_newer_steps_removes_only_markers_in_other_ranks_folders(local_dir):
    job = os.path.join(local_dir, "job")
    mine = SlotRing(os.path.join(job, "rank-00000"), keep=2)
    other = os.path.join(job, "rank-00001")  # another local rank's ring owns these files
    os.makedirs(other)
    for step in (3, 5):
        with open(os.path.join(other, step_file(step)), "wb") as f:
            f.write(b"x" * 100)
        open(os.path.join(other, sidecar_file(step)), "w").close()
    abandon_newer(local_dir, "job", 3, mine)
    assert os.path.exists(os.path.join(other, sidecar_file(3)))  # not newer: untouched
    assert not os.path.exists(os.path.join(other, sidecar_file(5)))  # un-committed
    assert os.path.exists(os.path.join(other, step_file(5))), "another rank's slot file was deleted"
    mine.close()


def test_a_replica_larger_than_the_ram_disk_is_refused_before_allocation(local_dir):
    import torch

    from incluster.replication import Replicator

    rep = Replicator.__new__(Replicator)  # the decision alone: no store or process group needed
    rep.rank, rep.job, rep.local_dir, rep.keep, rep.rings, rep._refused = 0, "job", local_dir, 2, {}, {}
    rep.share = True
    assert rep._wants(1, 5, torch.tensor([5, 100, 4096, 0]), None) == 1
    assert rep._wants(1, 6, torch.tensor([6, 100, 1 << 60, 0]), None) == 0
    assert "room" in rep._refused[6]
    assert all(s.size == 0 for s in rep.rings[1].slots), "nothing may be allocated for a refused replica"
    for ring in rep.rings.values():
        ring.close()


def test_a_replica_identical_to_my_own_shard_is_asked_for_as_a_sidecar_only(local_dir):
    import torch

    from incluster.replication import OwnShard, Replicator

    rep = Replicator.__new__(Replicator)
    rep.rank, rep.job, rep.local_dir, rep.keep, rep.rings, rep._refused = 0, "job", local_dir, 2, {}, {}
    rep.share = True
    own = OwnShard(b"{}", b"", 4096, content=12345)
    assert rep._wants(1, 5, torch.tensor([5, 100, 4096, 12345]), own) == 2  # the same bytes: sidecar only
    assert rep._wants(1, 5, torch.tensor([5, 100, 4096, 999]), own) == 1  # other bytes: a full copy
    assert rep._wants(1, 5, torch.tensor([5, 100, 4096, 0]), own) == 1  # unknown: a full copy
    rep.share = False
    assert rep._wants(1, 5, torch.tensor([5, 100, 4096, 12345]), own) == 1  # share_replicas=False
    for ring in rep.rings.values():
        ring.close()


def test_a_commit_in_flight_is_never_dropped_as_unheld(local_dir, monkeypatch):
    """A slot filled in this process (a restore's heal, a replica) is renamed, marked and
    counted in one transition: a concurrent ``drop_unheld`` (a newer step just became
    global) never sees its final name unheld and deletes it."""
    import incluster.format.sidecar as sidecar_mod
    from incluster.format.checksum import compute
    from incluster.format.sidecar import Sidecar, read_sidecar
    from incluster.writer.local_commit import commit_received

    ring = SlotRing(os.path.join(local_dir, "job", "rank-00001"), keep=3)
    slot = ring.acquire(3, 5)
    ring.prepare(slot, 4096)
    slot.buf.fill_(7)
    sc = Sidecar("job", 3, 1, 2, "n0", step_file(3), compute(slot.mm, 4096), "fp", {"d": []})
    real = sidecar_mod.write_sidecar
    marker_started = threading.Event()

    def slow_marker(path, sidecar, fsync=False):  # the window between rename and mark
        marker_started.set()
        time.sleep(0.3)
        real(path, sidecar, fsync)

    monkeypatch.setattr("incluster.writer.local_commit.write_sidecar", slow_marker)
    committer = threading.Thread(target=lambda: commit_received(ring, slot, sc, "test", verified=True))
    committer.start()
    assert marker_started.wait(5)
    ring.drop_unheld(5)  # step 5 became global meanwhile: older unheld steps go
    committer.join(5)
    assert slot.state is SlotState.COMMITTED and slot.step == 3
    assert os.path.exists(os.path.join(ring.folder, step_file(3))), "the commit in flight lost its shard file"
    assert read_sidecar(os.path.join(ring.folder, sidecar_file(3))).step == 3
    ring.close()


def test_a_commit_whose_marker_cannot_be_written_leaves_the_slot_staged(local_dir, monkeypatch):
    from incluster.errors import CheckpointError

    ring = SlotRing(os.path.join(local_dir, "job", "rank-00000"), keep=2)
    slot = ring.acquire(4, 5)
    ring.prepare(slot, 4096)
    staging = slot.path

    def no_room():
        raise OSError(28, "No space left on device")

    try:
        ring.commit(slot, 4, no_room)
    except OSError:
        pass
    assert slot.state is SlotState.STAGING and slot.path == staging and os.path.exists(staging)
    assert not os.path.exists(os.path.join(ring.folder, step_file(4)))
    ring.fail(slot, 4)
    assert slot.state is SlotState.FREE
    import pytest

    with pytest.raises(CheckpointError):
        ring.commit(slot, 4, lambda: None)  # a slot that no longer holds the step is never committed
    ring.close()


def _commit(ring: SlotRing, step: int, fill: bytes = b"x") -> None:
    slot = ring.acquire(step, 5)
    ring.prepare(slot, 4096)
    ring.write_at(slot, 0, [fill * 4096])
    ring.commit(slot, step, lambda: open(os.path.join(ring.folder, sidecar_file(step)), "w").close())


def test_a_restores_copy_never_takes_a_newer_step_and_says_when_there_is_no_room(local_dir):
    """Newer steps stay while a restore of an older one runs (a restore that fails must
    not have dropped them): the restore's copy takes a free slot or an older step's, and
    a ring full of newer steps says so ahead (the restore then drops them first)."""
    ring = SlotRing(os.path.join(local_dir, "job", "rank-00000"), keep=3)
    for step in (120, 130, 140):
        _commit(ring, step)
    assert not ring.room_for_restore(110)
    with pytest.raises(CheckpointError, match="holds a step newer than 110"):
        ring.acquire_for_restore(110)
    assert ring.room_for_restore(125)
    slot = ring.acquire_for_restore(125)  # the oldest step older than it goes: 120
    assert ring.committed_steps() == [130, 140] and slot.step == 125


def test_a_discarded_step_gives_its_name_back_so_two_slots_never_share_a_file(local_dir):
    """A copy of step 20 was discarded (bad, or another timeline's) and the restore's new
    copy of 20 committed from another slot. The discarded slot still held the name
    step-20.safetensors: the next save that took it renamed the new copy away (step 20's
    record left without its shard) and both slots wrote one file."""
    ring = SlotRing(os.path.join(local_dir, "job", "rank-00000"), keep=3)
    _commit(ring, 10)
    _commit(ring, 20, b"o")
    ring.discard(10)  # a free slot ahead of the one holding 20
    slot = ring.acquire_for_restore(20)
    ring.prepare(slot, 4096)
    ring.write_at(slot, 0, [b"n" * 4096])
    ring.commit(slot, 20, lambda: open(os.path.join(ring.folder, sidecar_file(20)), "w").close())
    _commit(ring, 30)
    ring.set_global(30)
    _commit(ring, 40)
    shard = os.path.join(ring.folder, step_file(20))
    assert 20 in ring.committed_steps() and open(shard, "rb").read(1) == b"n"
    paths = [s.path for s in ring.slots]
    assert len(set(paths)) == len(paths), paths


def test_shared_replica_records_are_kept_for_keep_steps_not_only_the_newest(local_dir):
    """A data-parallel peer's replica is only its record (its bytes are my own shard):
    no slot holds it, and retention deleted every one older than the newest global step,
    so one lost node and one bad own copy lost the job. The newest ``keep`` stay."""
    ring = SlotRing(os.path.join(local_dir, "job", "rank-00001"), keep=2)
    for step in (5, 6, 7):
        open(os.path.join(ring.folder, sidecar_file(step)), "w").close()  # as _commit_shared writes them
        ring.set_global(step)
        ring.drop_unheld(step)
    assert sorted(os.listdir(ring.folder)) == [sidecar_file(6), sidecar_file(7)]
    ring.close()


def test_old_shards_a_replica_ring_holds_go_once_shared_records_supersede_them(local_dir):
    """A rank moved to another node: its old folder here became a replica ring holding its
    old own shards (adopted as committed slots). Its replicas now come as shared records,
    which take no slot, so those slots were never reused and their RAM never freed."""
    folder = os.path.join(local_dir, "job", "rank-00001")
    old = SlotRing(folder, keep=2)
    for step in (3, 4):
        _commit(old, step)
    old.close()
    ring = SlotRing(folder, keep=2)  # the next process adopts them
    assert ring.committed_steps() == [3, 4]
    for step in (5, 6):
        open(os.path.join(folder, sidecar_file(step)), "w").close()
        ring.set_global(step)
        ring.drop_unheld(step)
    assert sorted(os.listdir(folder)) == [sidecar_file(5), sidecar_file(6)]
    assert ring.committed_steps() == [] and all(s.state is SlotState.FREE for s in ring.slots)
    _commit(ring, 7)  # a retired slot is made again when a full replica comes
    assert os.path.getsize(os.path.join(folder, step_file(7))) == 4096
    ring.close()


def test_an_adopted_torn_staging_file_keeps_its_number_and_never_shares_a_file(tmp_path):
    """A run that crashed mid-save left .staging-0 beside two committed steps. Adopted slots
    were numbered by position, so the committed step 5 became slot 0 too: un-committing it
    renamed its file onto the torn one, and two slots then wrote one file."""
    folder = tmp_path / "rank-00000"
    folder.mkdir()
    for step in (5, 6):
        (folder / step_file(step)).write_bytes(b"x" * 64)
        (folder / sidecar_file(step)).write_text("{}")
    (folder / ".staging-0").write_bytes(b"torn" * 16)
    ring = SlotRing(str(folder), 3)
    assert sorted(s.index for s in ring.slots) == [0, 1, 2]
    assert [s.index for s in ring.slots if s.path.endswith(".staging-0")] == [0]
    ring.discard(5)
    paths = [s.path for s in ring.slots]
    assert len(set(paths)) == 3, paths
    assert sorted(os.listdir(folder)) == sorted([".staging-0", ".staging-1", step_file(6), sidecar_file(6)])
    assert (folder / ".staging-0").read_bytes() == b"torn" * 16  # not overwritten by step 5's file
    ring.close()


def test_retention_leaves_alone_a_slot_the_staging_thread_maps_ahead(local_dir, monkeypatch):
    """After a restart the slot the next save takes is mapped (and page-locked on a GPU)
    ahead, on the staging thread, while the writer's replies run retention. Retention
    retired that very slot under the mapping - its file closed (its fd number free for
    another file to take) and unmapped while being mapped or page-locked. It waits now:
    the slot is retired at the next retention, after the mapping."""
    from incluster.staging.engine import Stager

    folder = os.path.join(local_dir, "rank-00000")
    os.makedirs(folder)
    for step in (1, 2, 3):
        with open(os.path.join(folder, step_file(step)), "wb") as f:
            f.write(b"x" * 4096)
        open(os.path.join(folder, sidecar_file(step)), "w").close()
    ring = SlotRing(folder, keep=2)  # a restart: slots hold steps 2 and 3, unmapped
    stager = Stager.__new__(Stager)
    stager.ring, stager.pin = ring, False
    ahead = ring.next_taken(4096)
    assert ahead is not None and ahead.step == 2
    open(os.path.join(folder, sidecar_file(4)), "w").close()  # step 4 committed meanwhile: 2 is past retention
    real = ring.prepare

    def prepare_while_retention_runs(slot, size):  # the writer's reply lands half way through the mapping
        ring.drop_unheld(4)
        return real(slot, size)

    monkeypatch.setattr(ring, "prepare", prepare_while_retention_runs)
    stager.map_ahead(ahead, 4096)
    assert ahead.state is SlotState.COMMITTED and ahead.step == 2 and ahead.buf is not None and ahead.fd >= 0
    assert bytes(ahead.buf[:4]) == b"xxxx"  # step 2's own file, mapped
    monkeypatch.setattr(ring, "prepare", real)
    ring.drop_unheld(4)  # the next retention retires it
    assert ahead.state is SlotState.FREE and ahead.buf is None
    assert not os.path.exists(os.path.join(folder, step_file(2)))
    ring.close()
