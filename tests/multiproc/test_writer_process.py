"""The writer process: started once, watched, bounded waits, dies with its trainer."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import incluster
from incluster.testing import FaultInjector

pytestmark = pytest.mark.multiproc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_writer_process_commits_and_is_reused(local_dir):
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        pid = ck.writer_pid
        assert pid and pid != os.getpid() and _alive(pid)
        for step in range(1, 5):
            ck.save(step, {"w": torch.full((1000,), float(step))}).wait()
        assert ck.writer_pid == pid
    assert not _alive(pid)
    target = {"w": torch.zeros(1000)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 4 and torch.equal(target["w"], torch.full((1000,), 4.0))


def _wait_for_new_writer(ck, pid, timeout=60):
    deadline = time.monotonic() + timeout
    while ck.writer_pid in (pid, None):
        assert time.monotonic() < deadline, "no new writer process was started"
        time.sleep(0.05)


def test_a_killed_writer_is_replaced_and_later_saves_are_durable(local_dir, caplog):
    caplog.set_level(logging.WARNING, logger="incluster")
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        pid = ck.writer_pid
        os.kill(pid, signal.SIGKILL)
        _wait_for_new_writer(ck, pid)
        assert _alive(ck.writer_pid)
        ck.save(2, {"w": torch.full((10,), 2.0)}).wait()
        assert any(f"pid {pid}" in r.getMessage() and "SIGKILL" in r.getMessage() and "new writer" in r.getMessage()
                   for r in caplog.records)
    target = {"w": torch.zeros(10)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 2 and torch.equal(target["w"], torch.full((10,), 2.0))


def test_writer_pid_never_names_a_dead_writer(local_dir):
    """A monitor that reads writer_pid between a writer's death and its successor's start
    must not be handed the dead pid as the live writer's."""
    import threading

    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        pid = ck.writer_pid
        hold = threading.Event()
        ck._stage_pool.submit(hold.wait, 60)  # the successor starts on this pool: not yet
        try:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while ck._writer.dead is None:
                assert time.monotonic() < deadline, "the writer's death was not noticed"
                time.sleep(0.02)
            assert ck.writer_pid is None
        finally:
            hold.set()
        _wait_for_new_writer(ck, pid)
        assert _alive(ck.writer_pid)


def test_the_writer_starts_behind_the_constructor_and_load_does_not_wait_for_it(local_dir, monkeypatch):
    """The writer's start (a fresh interpreter importing torch, a second or more; held
    here) overlaps the restore and the training after it: load() waited for it, which
    made every restart's load() that much longer than its restore. A save made before it
    is up lands once it is."""
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="writer-start", action="slow").env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert not ck._writer._started.done()  # the constructor did not wait for it
        assert _alive(ck.writer_pid)
        assert ck.load({"w": torch.zeros(10)}) is None
        assert not ck._writer._started.done()  # nor did load()
        ck.save(1, {"w": torch.ones(10)}).wait(60)
        assert ck._writer._started.done() and ck._writer.dead is None


def test_a_writer_that_cannot_start_fails_the_saves_with_the_reason(local_dir, monkeypatch):
    """Every start fails: each save fails with why (never a hang), and once the restarts
    are spent, save() itself says so."""
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="writer-start").env().items())))
    ck = incluster.Checkpointer(local_dir=local_dir, job="w")
    try:
        assert ck.load({"w": torch.zeros(10)}) is None
        deadline = time.monotonic() + 90
        while True:
            try:
                ck.save(1, {"w": torch.ones(10)}).wait(60)
            except incluster.WriterProcessDied as exc:
                if "is not started again" in str(exc):
                    break
                assert "could not start" in str(exc) or "is not started again" in str(exc), exc
            assert time.monotonic() < deadline, "the saves never said the writer cannot start"
            time.sleep(0.2)
        with pytest.raises(incluster.WriterProcessDied, match="could not start: .*injected fault at writer-start"):
            ck.save(2, {"w": torch.ones(10)})
    finally:
        ck.close()


def test_a_writer_whose_first_start_fails_is_started_again_and_saves_land(local_dir, monkeypatch, caplog):
    """Even the save made while the first writer was still starting: it is handed only to
    a writer that answered, so the failed start held none."""
    caplog.set_level(logging.WARNING, logger="incluster")
    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=1.5)  # then it fails
    monkeypatch.setenv(*next(iter(faults.fail_at(phase="writer-start", step=0).env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        first = ck._writer
        assert ck.load({"w": torch.zeros(10)}) is None
        ck.save(1, {"w": torch.ones(10)}).wait(60)  # made while the first writer was still starting
        ck.save(2, {"w": torch.full((10,), 2.0)}).wait(60)
        assert ck._writer is not first and ck._writer.dead is None
    assert any("could not start" in r.getMessage() and "new writer" in r.getMessage() for r in caplog.records)
    target = {"w": torch.zeros(10)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 2 and torch.equal(target["w"], torch.full((10,), 2.0))


def test_saves_made_while_the_writer_starts_are_staged_at_once_and_land_in_order(local_dir, monkeypatch):
    """The writer's start is slow: every save made meanwhile is staged at once (the next
    optimizer step waits for nothing), and is handed over in save() order once the start
    is over - with a save refused in between told to the writer in its place."""
    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=3.0)
    monkeypatch.setenv(*next(iter(faults.env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w", keep=4) as ck:
        started = ck._writer.started
        told: list[int] = []  # the steps in the order the writer hears of them
        submit, fail = ck._writer.submit, ck._writer.fail
        ck._writer.submit = lambda req, slot: (told.append(req.step), submit(req, slot))[1]
        ck._writer.fail = lambda step, *a: (told.append(step), fail(step, *a))[1]
        handles = []
        for step in (1, 2):
            handles.append(ck.save(step, {"w": torch.full((10,), float(step))}))
            handles[-1].staged.result(30)
        assert not started.done(), "a save waited for the writer's start to be staged"
        with pytest.raises(incluster.CheckpointError):
            ck.save(3, {"w": lambda: None})  # refused in save(): step 3 is told failed, behind 1 and 2
        handles.append(ck.save(4, {"w": torch.full((10,), 4.0)}))
        handles[-1].staged.result(30)
        assert not started.done()
        for h in handles:
            h.wait(60)
        assert told == [1, 2, 3, 4]
    target = {"w": torch.zeros(10)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 4 and torch.equal(target["w"], torch.full((10,), 4.0))


def test_a_save_finding_every_slot_held_for_the_writer_start_takes_the_oldest_one(local_dir, monkeypatch):
    """keep=2 and three saves before the writer has started: the third does not wait for
    the start; the first gives up its slot (its handle says why, in order for the writer)
    and the newer steps land."""
    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=3.0)
    monkeypatch.setenv(*next(iter(faults.env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w", keep=2) as ck:
        started = ck._writer.started
        told: list[tuple[str, int]] = []
        submit, fail = ck._writer.submit, ck._writer.fail
        ck._writer.submit = lambda req, slot: (told.append(("save", req.step)), submit(req, slot))[1]
        ck._writer.fail = lambda step, *a: (told.append(("fail", step)), fail(step, *a))[1]
        handles = [ck.save(step, {"w": torch.full((10,), float(step))}) for step in (1, 2)]
        deadline = time.monotonic() + 30
        while ck._handover.waiting < 2:  # both staged and queued for the start: every slot held
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handles.append(ck.save(3, {"w": torch.full((10,), 3.0)}))
        handles[-1].staged.result(30)
        assert not started.done(), "save(3) waited for the writer's start"
        with pytest.raises(incluster.CheckpointError,
                           match=r"step 1 was not saved \(superseded .*\): save\(3\) took its slot"):
            handles[0].wait(60)
        handles[1].wait(60)
        handles[2].wait(60)
        ck.wait(60)  # step 1's failure is older than the durable step 3: not raised again
        assert told == [("fail", 1), ("save", 2), ("save", 3)]
        ck.save(4, {"w": torch.full((10,), 4.0)}).wait(60)  # and the next save is as usual
    target = {"w": torch.zeros(10)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 4 and torch.equal(target["w"], torch.full((10,), 4.0))


def test_a_save_asked_to_persist_is_given_up_last(local_dir, tmp_path, monkeypatch):
    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=3.0)
    monkeypatch.setenv(*next(iter(faults.env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w", keep=2, persistent=str(tmp_path / "tier"),
                                persistent_every=1000) as ck:
        handles = [ck.save(1, {"w": torch.ones(10)}, persist=True)]
        handles += [ck.save(step, {"w": torch.full((10,), float(step))}) for step in (2, 3)]
        deadline = time.monotonic() + 30
        while ck._handover.waiting < 3:  # 3 slots (keep=2, +1: a tier), each held by a queued save
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handles.append(ck.save(4, {"w": torch.full((10,), 4.0)}))
        assert not ck._writer.started.done()
        with pytest.raises(incluster.CheckpointError, match=r"step 2 was not saved \(superseded"):
            handles[1].wait(60)
        for h in (handles[0], handles[2], handles[3]):
            h.wait(60)
        assert handles[0].persisted.result(60) is True


def test_a_run_whose_due_saves_were_given_up_ends_with_its_newest_step_in_the_tier(local_dir, tmp_path, monkeypatch):
    """The README loop from a cold start: every save due for the tier came while the writer
    started and was given up for a newer one; close() uploads the newest durable step (the
    tier was left empty, the run believed to outlive its nodes)."""
    import glob

    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=2.0)
    monkeypatch.setenv(*next(iter(faults.env().items())))
    tier = str(tmp_path / "tier")
    with incluster.Checkpointer(local_dir=local_dir, job="w", persistent=tier, persistent_every=5) as ck:
        handles = [ck.save(step, {"w": torch.full((10,), float(step))}) for step in range(0, 200, 10)]
        assert not ck._writer.started.done()
    durable = [h.step for h in handles if h.durable.exception() is None]
    assert durable and len(durable) < len(handles), durable
    assert glob.glob(f"{tier}/w/step-{durable[-1]:012d}/COMMITTED.json"), glob.glob(f"{tier}/w/*/*")
    shutil.rmtree(os.path.join(local_dir, "w"))
    target = {"w": torch.zeros(10)}
    with incluster.Checkpointer(local_dir=local_dir, job="w", persistent=tier) as ck:
        assert ck.load(target) == durable[-1] and ck.last_restore.source == "persistent"


def test_a_failure_told_while_the_writer_starts_reaches_it_even_when_close_follows(local_dir, monkeypatch):
    """A refused save's FAIL waits for the writer's start; close() right after, with no
    save pending, must still hand it over (the other ranks would wait slot_timeout_s)."""
    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=2.0)
    monkeypatch.setenv(*next(iter(faults.env().items())))
    ck = incluster.Checkpointer(local_dir=local_dir, job="w")
    told: list[tuple[int, str]] = []
    fail = ck._writer.fail

    def record(step, *a):
        try:
            fail(step, *a)
            told.append((step, "sent"))
        except Exception as exc:  # noqa: BLE001
            told.append((step, f"{type(exc).__name__}: {exc}"))

    ck._writer.fail = record
    with pytest.raises(incluster.CheckpointError):
        ck.save(1, {"w": lambda: None})
    assert not ck._writer.started.done()
    ck.close()
    assert told == [(1, "sent")]


def test_a_save_refused_as_not_newer_gives_up_no_queued_step(local_dir, monkeypatch):
    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=2.0)
    monkeypatch.setenv(*next(iter(faults.env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w", keep=2) as ck:
        handles = [ck.save(step, {"w": torch.full((10,), float(step))}) for step in (1, 2)]
        deadline = time.monotonic() + 30
        while ck._handover.waiting < 2:  # both queued for the start, every slot held
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not ck._writer.started.done()
        with pytest.raises(incluster.CheckpointError, match="not newer"):
            ck.save(2, {"w": torch.ones(10)})
        for h in handles:
            h.wait(60)  # step 1 kept its slot


class _GatedLock:
    """The writer's lock, but the test thread takes it only once the start has failed:
    the moment between a look at the writer and the lock, made long."""

    def __init__(self, lock, started):
        self.lock, self.started, self.thread = lock, started, threading.current_thread()

    def __enter__(self):
        if threading.current_thread() is self.thread:
            with contextlib.suppress(Exception):
                self.started.exception(60)
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_a_failed_save_told_while_the_writer_start_fails_still_reaches_the_other_ranks(local_dir, monkeypatch):
    """fail() while the first writer is still starting, its start failing just then: the
    other ranks hear of the step from this process (never a FAIL left in a socket the dead
    writer never reads, which would leave them waiting slot_timeout_s)."""
    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=1.5)  # then it fails
    monkeypatch.setenv(*next(iter(faults.fail_at(phase="writer-start", step=0).env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        w = ck._writer
        assert not w._started.done()
        told: list[int] = []
        w._publish_failed = lambda step, reason, seq: told.append(step)
        w._send = lambda msg: None  # a send into a socket nobody reads: "succeeds"
        w._lock = _GatedLock(w._lock, w._started)
        w.fail(7, "save() raised on rank 0", (-1, 0, 0))
        assert w.dead is not None
        assert told == [7]


def test_replicas_asked_of_a_writer_whose_start_fails_are_asked_of_its_successor(local_dir, monkeypatch):
    """load() asks the writer to re-send the restored step's replicas while it may still be
    starting; a start that fails then never read the request, so the next writer gets it
    (the partners would otherwise miss the restored step's copies until a later save)."""
    from incluster.writer.process import ProcessWriter

    faults = FaultInjector().fail_at(phase="writer-start", step=0, action="slow", seconds=1.5)  # then it fails
    monkeypatch.setenv(*next(iter(faults.fail_at(phase="writer-start", step=0).env().items())))
    asked: list[tuple[object, str, int]] = []
    replicate = ProcessWriter.replicate

    def record(self, folder, step):
        asked.append((self, folder, step))
        return replicate(self, folder, step)

    monkeypatch.setattr(ProcessWriter, "replicate", record)
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        first = ck._writer
        assert not first._started.done()
        first.replicate(ck.folder, 3)
        deadline = time.monotonic() + 30
        while len(asked) < 2:
            assert time.monotonic() < deadline, f"the successor was never asked: {asked}"
            time.sleep(0.05)
        assert asked[1] == (ck._writer, ck.folder, 3) and ck._writer is not first
        assert ck._writer.dead is None


def test_a_save_in_flight_when_the_writer_dies_fails_and_the_next_one_lands(local_dir, monkeypatch):
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="commit", step=2, action="kill").env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        pid = ck.writer_pid
        with pytest.raises(incluster.WriterProcessDied, match=rf"pid {pid}.*SIGKILL"):
            ck.save(2, {"w": torch.full((10,), 2.0)}).wait()
        monkeypatch.delenv("INCLUSTER_FAULTS")  # read by the writer at start: the next one is healthy
        _wait_for_new_writer(ck, pid)
        ck.save(3, {"w": torch.full((10,), 3.0)}).wait()
        assert not os.path.exists(os.path.join(ck.folder, "step-000000000002.json"))
    target = {"w": torch.zeros(10)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 3 and torch.equal(target["w"], torch.full((10,), 3.0))


def test_saves_lost_with_one_writer_each_have_their_own_error(local_dir, monkeypatch):
    """Steps 2 and 3 are in flight when the writer is SIGKILLed: each handle raises its own
    error, and the note wait() adds (naming step 3) lands on step 2's error alone, once."""
    faults = FaultInjector().fail_at(phase="commit", step=2, action="slow", seconds=1.0)  # then it is killed
    monkeypatch.setenv(*next(iter(faults.fail_at(phase="commit", step=2, action="kill").env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w", keep=3) as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        h2 = ck.save(2, {"w": torch.full((10,), 2.0)})
        h3 = ck.save(3, {"w": torch.full((10,), 3.0)})
        with pytest.raises(incluster.WriterProcessDied) as raised:
            ck.wait(60)
        e2, e3 = h2.durable.exception(60), h3.durable.exception(60)
        assert isinstance(e2, incluster.WriterProcessDied) and isinstance(e3, incluster.WriterProcessDied)
        assert raised.value is e2 and e3 is not e2
        notes2, notes3 = getattr(e2, "__notes__", []), getattr(e3, "__notes__", [])
        assert sum("later save(s) failed too" in n for n in notes2) == 1, notes2
        assert not any("later save(s)" in n for n in notes3), notes3
        assert str(e2) == str(e3)  # the same death, told alike
        monkeypatch.delenv("INCLUSTER_FAULTS")


def test_a_step_the_writer_committed_before_it_died_stays_durable(local_dir, monkeypatch):
    """SIGKILL after the writer committed step 2 (renamed, sidecar written, counted) but
    before it told the trainer: the step is whole on disk, so it is durable - not
    un-committed and reported lost."""
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="counted", step=2, action="kill").env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        pid = ck.writer_pid
        ck.save(2, {"w": torch.full((10,), 2.0)}).wait()
        monkeypatch.delenv("INCLUSTER_FAULTS")
        _wait_for_new_writer(ck, pid)
        assert os.path.exists(os.path.join(ck.folder, "step-000000000002.safetensors"))
    target = {"w": torch.zeros(10)}
    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        assert ck.load(target) == 2 and torch.equal(target["w"], torch.full((10,), 2.0))


def test_a_writer_that_keeps_dying_is_started_again_only_so_often(local_dir):
    from incluster.saving import MAX_WRITER_RESTARTS

    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        for _ in range(MAX_WRITER_RESTARTS):
            pid = ck.writer_pid
            os.kill(pid, signal.SIGKILL)
            _wait_for_new_writer(ck, pid)
        last = ck.writer_pid
        os.kill(last, signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(incluster.WriterProcessDied, match=rf"pid {last}.*SIGKILL.*not started again"):
            ck.save(2, {"w": torch.ones(10)}).wait()
        assert ck.writer_pid is None  # no live writer, and none is started
        target = {"w": torch.zeros(10)}
        assert ck.load(target) == 1 and torch.equal(target["w"], torch.ones(10))


def test_saves_made_while_the_last_restart_starts_its_writer_are_not_refused(local_dir, monkeypatch):
    """The restart count went up before the successor existed: while the third (last)
    successor started, every save() raised "started again 3 times ... not started again"
    and the other ranks were told this rank was gone - then the new writer came up and
    saved on."""
    from incluster import writer_keeping
    from incluster.saving import MAX_WRITER_RESTARTS

    spawner = writer_keeping.writer_spawner()
    started, release = threading.Event(), threading.Event()

    class Slow:
        def submit(self, *a, **k):  # a fresh interpreter on a busy node: held until save(2) was made
            started.set()
            release.wait(30)
            return spawner.submit(*a, **k)

    with incluster.Checkpointer(local_dir=local_dir, job="w") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        for _ in range(MAX_WRITER_RESTARTS - 1):
            pid = ck.writer_pid
            os.kill(pid, signal.SIGKILL)
            _wait_for_new_writer(ck, pid)
        monkeypatch.setattr(writer_keeping, "writer_spawner", lambda: Slow())
        os.kill(ck.writer_pid, signal.SIGKILL)
        assert started.wait(30)
        h = ck.save(2, {"w": torch.full((10,), 2.0)})  # during the last restart: waits for it
        release.set()
        h.wait(60)
        target = {"w": torch.zeros(10)}
        assert ck.load(target) == 2 and torch.equal(target["w"], torch.full((10,), 2.0))


def test_no_free_slot_times_out_and_keeps_the_newest_step(local_dir, monkeypatch):
    marker_dir = os.path.join(local_dir, "m")
    os.makedirs(marker_dir)
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="commit", step=2, action="hang", marker_dir=marker_dir).env().items())))
    ck = incluster.Checkpointer(local_dir=local_dir, job="w", slot_timeout_s=1.5)
    try:
        ck.save(1, {"w": torch.ones(10)}).wait()
        ck.save(2, {"w": torch.ones(10) * 2})  # its commit hangs in the writer
        t = time.monotonic()
        with pytest.raises(incluster.PeerTimeoutError, match="no checkpoint slot became free"):
            ck.save(3, {"w": torch.ones(10) * 3})
        assert 1.0 < time.monotonic() - t < 10
        assert os.path.exists(os.path.join(ck.folder, "step-000000000001.json"))
    finally:
        pid = ck.writer_pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(incluster.CheckpointError):
            ck.close()


CHILD = textwrap.dedent(
    """
    import sys, time, torch, incluster
    ck = incluster.Checkpointer(local_dir=sys.argv[1], job="orphan")
    if sys.argv[2] == "save":
        ck.save(1, {"w": torch.ones(4)}).wait()
    print(ck.writer_pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("busy", ["save", "hung"])
def test_writer_exits_when_its_trainer_is_killed(local_dir, tmp_path, busy):
    """Also a writer that is not reading its socket (hung in its start here): it must not
    outlive a SIGKILLed trainer, wherever it was started from."""
    env = dict(os.environ)
    if busy == "hung":
        env.update(FaultInjector().fail_at(phase="writer-start", action="hang", marker_dir=str(tmp_path)).env())
    proc = subprocess.Popen([sys.executable, "-c", CHILD, local_dir, busy], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid = int(proc.stdout.readline())
        assert _alive(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the writer outlived its trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_writer_that_stops_reading_is_killed_after_a_bounded_send(local_dir):
    """A stopped (or deadlocked) writer never blocks the staging thread for ever: a send
    it does not take within 3 x slot_timeout_s kills it, and the restart path follows."""
    from incluster.writer.protocol import Kind, Message

    with incluster.Checkpointer(local_dir=local_dir, job="w", slot_timeout_s=1.0) as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        writer, pid = ck._writer, ck.writer_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="took no message"):
                writer._send(Message(Kind.FAIL, writer.gen, step=99, error="x" * (8 << 20)))  # > the socket buffer
            assert time.monotonic() - t0 < 10
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        writer.proc.wait(10)
        assert not _alive(pid)


def test_without_a_writer_server_the_writer_is_a_fresh_interpreter(local_dir, monkeypatch):
    """The suite forks writers from its server (incluster.testing.writer_server); a job
    never has one, and its writer is `python -m incluster.writer.worker`, as here."""
    from incluster.testing import writer_server

    monkeypatch.delenv(writer_server.ENV, raising=False)
    with incluster.Checkpointer(local_dir=local_dir, job="fresh") as ck:
        assert isinstance(ck._writer.proc, subprocess.Popen)
        ck.save(1, {"w": torch.ones(10)}).wait(60)
        with open(f"/proc/{ck.writer_pid}/cmdline", "rb") as f:
            assert b"incluster.writer.worker" in f.read()


STOP_SCRIPT = textwrap.dedent('''
    import signal, sys, torch, incluster
    m = torch.nn.Linear(64, 64)
    o = torch.optim.AdamW(m.parameters())
    ck = incluster.Checkpointer(local_dir=sys.argv[1], job="stop")
    state = {"model": m, "optim": o}
    m(torch.randn(4, 64)).sum().backward(); o.step()

    def on_stop(sig, frame):  # a scheduler's "stop": one last save, then out
        try:
            ck.save(99, state).wait(60)
            print("last save durable", flush=True)
        except Exception as exc:
            print("LAST SAVE FAILED:", type(exc).__name__, exc, flush=True)
        ck.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGUSR1, on_stop)
    ck.prepare(state).result(120)  # the writer process is up
    ck.save(1, state).wait(60)
    print("ready", ck.writer_pid, flush=True)
    signal.pause()
''')


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_to_the_whole_process_group_leaves_the_writer_for_the_last_save(local_dir, tmp_path, sig):
    """torchrun stops its workers with SIGTERM to their process group, `timeout` likewise,
    SLURM signals every process of the job (Lightning's requeue: SIGUSR1): the writer took
    the signal too and died, so the handler's last save failed."""
    from incluster.testing import writer_server

    script = tmp_path / "stop.py"
    script.write_text(STOP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != writer_server.ENV}  # a real `python -m` writer
    proc = subprocess.Popen([sys.executable, str(script), local_dir], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), line + proc.stdout.read()
        writer = int(line.split()[1])
        os.killpg(proc.pid, sig)  # the trainer's group: as torchrun and `timeout` do
        with contextlib.suppress(ProcessLookupError):
            os.kill(writer, sig)  # and the writer itself: as SLURM signals every process of the job
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "last save durable" in out, out
    assert os.path.exists(os.path.join(local_dir, "stop", "rank-00000", "step-000000000099.json")), out


def test_a_checkpointer_made_on_a_thread_that_ends_keeps_its_writer(local_dir, monkeypatch):
    """The parent-death signal follows the thread that started a process: a Checkpointer
    made on a worker thread lost its writer (SIGKILL) when that thread ended."""
    from incluster.testing import writer_server

    monkeypatch.delenv(writer_server.ENV, raising=False)  # a real `python -m` writer, started by this process
    box: dict = {}

    def make() -> None:
        box["ck"] = incluster.Checkpointer(local_dir=local_dir, job="thread-made")
        box["ck"].prepare({"w": torch.ones(10)}).result(120)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    ck = box["ck"]
    pid = ck.writer_pid
    time.sleep(0.5)  # a parent-death SIGKILL is immediate
    try:
        assert _alive(pid)
        ck.save(1, {"w": torch.ones(10)}).wait(60)
        assert ck.writer_pid == pid and ck._writer_restarts == 0
    finally:
        ck.close()


def test_a_save_not_durable_in_time_because_the_writer_is_stopped_says_so(local_dir):
    # wait() said only "did not become durable in time": neither the cause nor what follows
    with incluster.Checkpointer(local_dir=local_dir, job="stopped") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait(60)
        pid = ck.writer_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            ck.save(2, {"w": torch.full((10,), 2.0)})
            time.sleep(4)  # the writer's silence is seen after 3 missed heartbeats
            with pytest.raises(incluster.PeerTimeoutError, match=r"step 2 .*writer process \(pid \d+\) has sent "
                                                                  r"nothing for \d+ s.*SIGSTOP"):
                ck.wait(timeout=1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


EXIT_SCRIPT = textwrap.dedent('''
    import atexit, os, sys, torch, incluster
    ck = incluster.Checkpointer(local_dir=sys.argv[1], job="atexit")
    ck.save(1, {"w": torch.ones(8)}).wait(60)

    def last_words():  # a user's own exit hook: the writer must still be there, close() must not hang
        with open(f"/proc/{ck.writer_pid}/stat") as f:
            print("writer alive at exit" if f.read().split(")")[-1].split()[0] != "Z" else "WRITER GONE", flush=True)
        try:
            ck.save(2, {"w": torch.full((8,), 2.0)})
        except incluster.CheckpointError as exc:  # the staging thread's pool is shut down by now
            print("save at exit refused:", exc, flush=True)
        ck.close()
        print("closed at exit", flush=True)

    atexit.register(last_words)
    if os.fork() == 0:  # a child forked after a Checkpointer was made makes its own
        try:
            with incluster.Checkpointer(local_dir=sys.argv[1], job="child") as child:
                child.save(1, {"w": torch.ones(8)}).wait(60)
            print("child saved", flush=True)
        finally:
            os._exit(0)
    os.wait()
''')


def test_a_forked_child_makes_its_own_checkpointer_and_exit_hooks_still_have_the_writer(local_dir, tmp_path):
    """The thread that starts writers was a pool's: a forked child inherited the pool
    without its thread (its Checkpointer() hung for ever), and the interpreter joined it
    at exit before the atexit hooks (the writer died with it). A save() in such a hook
    left a handle close() waited for slot_timeout_s."""
    from incluster.testing import writer_server

    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != writer_server.ENV}
    out = subprocess.run([sys.executable, str(script), local_dir], capture_output=True, text=True, timeout=120, env=env)
    said = out.stdout + out.stderr
    assert out.returncode == 0 and "child saved" in out.stdout and "writer alive at exit" in out.stdout, said
    assert "save at exit refused: save(2) cannot be staged" in out.stdout and "closed at exit" in out.stdout, said


def test_a_save_not_durable_in_time_while_the_writer_starts_says_so(local_dir, monkeypatch):
    # wait() raised AttributeError (nothing heard from a writer not started yet)
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="writer-start", action="slow", seconds=5)
                                  .env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="starting") as ck:
        ck.save(1, {"w": torch.ones(10)})
        with pytest.raises(incluster.PeerTimeoutError, match="writer process is still starting"):
            ck.wait(timeout=0.5)
