"""The trainer's bookkeeping for drains run by the writer process (gpu_drain="writer"):
which writer has which buffer open, and that a buffer is never copied into again while
a writer may still read it. The CUDA half runs in tests/gpu."""

from __future__ import annotations

import threading
import time

import pytest

from incluster.errors import CheckpointError
from incluster.staging.remote_drain import RemoteDrain


class FakeWriter:
    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.dead = None
        self.shared: list[tuple[int, object, list]] = []
        self.pinned: list[list] = []

    def share_device_buffer(self, buf_id, buf, slots):
        self.shared.append((buf_id, buf, slots))

    def pin_slot_files(self, slots):
        self.pinned.append(slots)


def _remote(writer, files=None):
    box = {"w": writer}
    return RemoteDrain(lambda: box["w"], lambda: list(files if files is not None else [(0, "/x", 8, 1)])), box


def test_a_buffer_is_used_only_once_the_current_writer_has_it_open():
    w = FakeWriter(1)
    r, box = _remote(w)
    buf = object()
    assert r.offer(buf) is False and len(w.shared) == 1  # shared, not yet open
    assert r.offer(buf) is False and len(w.shared) == 1  # not shared twice
    r.on_ready(1, r.buf_id, None)
    assert r.offer(buf) is True and r.is_open(w)
    # a restarted writer has nothing open: shared again, the trainer drains meanwhile
    box["w"] = w2 = FakeWriter(2)
    assert r.offer(buf) is False and len(w2.shared) == 1
    r.on_ready(1, r.buf_id, None)  # a late answer from the dead writer opens nothing
    assert r.offer(buf) is False
    r.on_ready(2, r.buf_id, None)
    assert r.offer(buf) is True
    # a new buffer (the shard grew) gets a new id and is shared again
    assert r.offer(object()) is False and w2.shared[-1][0] == r.buf_id == 2


def test_a_writer_that_cannot_open_the_buffer_leaves_the_drain_to_the_trainer(caplog):
    w = FakeWriter(1)
    r, _ = _remote(w)
    r.offer(object())
    r.on_ready(1, r.buf_id, "RuntimeError: no CUDA")
    assert r.offer(object()) is False
    assert any("cannot drain" in rec.getMessage() for rec in caplog.records)


def test_the_buffer_waits_for_the_drain_of_its_own_step_only():
    r, _ = _remote(FakeWriter(1))
    r.begin(5)
    r.done(4)  # news of another step frees nothing
    with pytest.raises(CheckpointError, match="step 5"):
        r.wait_free(0.05)
    t = threading.Timer(0.1, r.done, args=(5,))
    t.start()
    t0 = time.perf_counter()
    r.wait_free(5)
    assert 0.05 < time.perf_counter() - t0 < 5
    r.wait_free(0)  # free stays free


def test_a_dead_writer_is_never_offered_the_buffer():
    w = FakeWriter(1)
    w.dead = RuntimeError("gone")
    r, _ = _remote(w)
    assert r.offer(object()) is False and w.shared == []


def test_each_steps_drain_time_is_kept_until_its_commit_takes_it():
    # The writer copies step 6 while step 5 still commits: 6's DRAINED may come first.
    r, _ = _remote(FakeWriter(1))
    r.begin(5)
    r.done(5)
    r.begin(6)
    r.done(6)
    t5, t6 = r.drained_at(5), r.drained_at(6)
    assert t5 is not None and t6 is not None and t5 <= t6
    assert r.drained_at(5) is None  # taken once
    assert r.drained_at(7) is None  # never drained


def test_slots_mapped_after_the_buffer_was_shared_are_page_locked_ahead_by_that_writer():
    # After a restart the slot the next save takes over is mapped ahead, after the buffer
    # was shared: the writer is told to page-lock it then, not in the drain into it.
    files = [(0, "/s0", 8, 1)]
    w = FakeWriter(1)
    r, box = _remote(w, files)
    buf = object()
    r.offer(buf)
    assert w.shared[0][2] == [(0, "/s0", 8, 1)]
    r.pin_ahead()
    assert w.pinned == []  # not open yet: nothing to tell
    r.on_ready(1, r.buf_id, None)
    r.pin_ahead()
    assert w.pinned == []  # every mapped slot was in the offer
    files.append((1, "/s1", 8, 1))  # mapped ahead
    r.pin_ahead()
    r.pin_ahead()
    assert w.pinned == [[(1, "/s1", 8, 1)]]  # told once
    files[0] = (0, "/s0", 8, 2)  # re-mapped (cut and grown back): its new pages
    r.pin_ahead()
    assert w.pinned[-1] == [(0, "/s0", 8, 2)]
    # a restarted writer is offered every mapped slot with the buffer, and told of no old one
    box["w"] = w2 = FakeWriter(2)
    r.offer(buf)
    assert w2.shared[0][2] == files
    r.on_ready(2, r.buf_id, None)
    r.pin_ahead()
    assert w2.pinned == []


def test_a_slot_mapped_between_the_offer_and_the_writers_answer_is_told_once_the_buffer_is_open():
    # After a restart: the first save offers the buffer, then maps the next slot ahead
    # before the writer has answered; that slot is told as soon as the writer has.
    files = [(0, "/s0", 8, 1)]
    w = FakeWriter(1)
    r, _ = _remote(w, files)
    r.offer(object())
    files.append((1, "/s1", 8, 1))
    r.on_ready(1, r.buf_id, None)
    deadline = time.monotonic() + 5
    while not w.pinned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.pinned == [[(1, "/s1", 8, 1)]]
