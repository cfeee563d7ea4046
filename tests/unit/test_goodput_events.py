"""goodput.events: what the recorder writes, when it reaches the file, and SIGKILL safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from incluster.goodput import events as ev
from incluster.goodput.events import NULL_RECORDER, EventRecorder, NullRecorder
from incluster.goodput.report import build_report


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_event_lines_carry_time_kind_rank_pid_and_fields(tmp_path: Path) -> None:
    clock = iter([100.0, 101.5])
    with EventRecorder(tmp_path / "run", rank=3, clock=lambda: next(clock)) as rec:
        rec.record(ev.START, world_size=4)
        rec.record(ev.SAVE, step=7, blocked_s=0.25)
    proc = ev.process_token()
    assert len(proc) == 12 and rec.path == tmp_path / "run" / f"events-rank00003-pid{os.getpid()}-{proc}.jsonl"
    assert lines(rec.path) == [
        {"t": 100.0, "kind": "start", "rank": 3, "pid": os.getpid(), "proc": proc, "world_size": 4},
        {"t": 101.5, "kind": "save", "rank": 3, "pid": os.getpid(), "step": 7, "blocked_s": 0.25},
    ]


def _soon(path: Path, n: int) -> list[dict]:
    """The file's events once it holds ``n`` of them (the recorder's thread writes them)."""
    deadline = time.monotonic() + 5
    while len(lines(path)) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return lines(path)


def test_checkpoint_events_are_written_at_once_steps_are_batched(tmp_path: Path) -> None:
    rec = EventRecorder(tmp_path, flush_every=3, flush_interval_s=3600)
    rec.record(ev.TRAIN_STEP, step=0)
    rec.record(ev.TRAIN_STEP, step=1)
    time.sleep(0.1)
    assert rec.path.read_text() == ""  # buffered: cheap
    rec.record(ev.TRAIN_STEP, step=2)  # the third event reaches flush_every
    assert [e["step"] for e in _soon(rec.path, 3)] == [0, 1, 2]
    rec.record(ev.TRAIN_STEP, step=3)
    rec.record(ev.DURABLE, step=3, tier="local", seconds=0.1)  # written with what is pending
    assert [e["kind"] for e in _soon(rec.path, 5)][-2:] == ["train_step", "durable"]
    rec.record(ev.TRAIN_STEP, step=4)
    rec.flush()
    assert lines(rec.path)[-1]["step"] == 4
    rec.close()
    rec.record(ev.TRAIN_STEP, step=5)  # after close: counted, never raised
    assert rec.dropped == 1 and len(lines(rec.path)) == 6


def test_steps_reach_the_file_once_the_flush_interval_passed(tmp_path: Path) -> None:
    rec = EventRecorder(tmp_path, flush_interval_s=0.05)
    rec.record(ev.TRAIN_STEP, step=0)
    rec.record(ev.TRAIN_STEP, step=1)
    assert [e["step"] for e in _soon(rec.path, 2)] == [0, 1]
    rec.close()


def test_recording_does_no_file_io_on_the_recording_thread(tmp_path: Path, monkeypatch) -> None:
    """save() records an event on the training thread: a write there hands the
    interpreter lock to the staging thread save() just started, for up to 5 ms."""
    rec = EventRecorder(tmp_path, flush_interval_s=3600)
    me = threading.get_ident()
    writers: list[int] = []
    real = rec._file.write
    monkeypatch.setattr(rec._file, "write", lambda text: (writers.append(threading.get_ident()), real(text))[1])
    for i in range(50):
        rec.record(ev.SAVE, step=i, blocked_s=0.0)
    assert len(_soon(rec.path, 50)) == 50
    rec.close()
    assert writers and me not in writers


def test_alive_marks_training_until_shortly_before_a_kill(tmp_path: Path) -> None:
    clock = [100.0]
    rec = EventRecorder(tmp_path, clock=lambda: clock[0], flush_interval_s=0.02)
    rec.record(ev.START, world_size=1)
    for t in (101.0, 102.0, 103.5):
        clock[0] = t
        rec.alive()
        time.sleep(0.06)
    alive = [e["t"] for e in lines(rec.path) if e["kind"] == ev.ALIVE]
    assert alive == [101.0, 102.0, 103.5]  # once per interval with a step, never repeated
    rec.close()


def test_odd_field_values_are_written_as_text(tmp_path: Path) -> None:
    with EventRecorder(tmp_path, clock=lambda: 1.0) as rec:
        rec.record(ev.LOAD, step=3, source=tmp_path, bytes=10, seconds=0.5)
    assert lines(rec.path)[0]["source"] == str(tmp_path)


def test_unknown_kind_and_bad_options_are_rejected(tmp_path: Path) -> None:
    rec = EventRecorder(tmp_path)
    with pytest.raises(ValueError, match="unknown event kind 'saved'"):
        rec.record("saved", step=1)
    with pytest.raises(ValueError, match="flush_every"):
        EventRecorder(tmp_path, flush_every=0)
    with pytest.raises(ValueError, match="rank"):
        EventRecorder(tmp_path, rank=-1)
    rec.close()


def test_threads_record_whole_lines(tmp_path: Path) -> None:
    rec = EventRecorder(tmp_path, flush_every=7)

    def work(k: int) -> None:
        for i in range(500):
            rec.record(ev.TRAIN_STEP, step=k * 1000 + i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    got = sorted(e["step"] for e in lines(rec.path))
    assert got == sorted(k * 1000 + i for k in range(4) for i in range(500))


def test_null_recorder_does_nothing(tmp_path: Path) -> None:
    for rec in (NullRecorder(), NULL_RECORDER):
        rec.record("anything", step=1)
        rec.flush()
        rec.close()
    assert list(tmp_path.iterdir()) == []


CHILD = """
import sys, time
from incluster.goodput.events import EventRecorder
rec = EventRecorder(sys.argv[1], rank=0)
rec.record("start", world_size=1)
i = 0
while True:
    rec.record("train_step", step=i)
    if i == 20:
        rec.record("save", step=20, blocked_s=0.001)
    i += 1
    time.sleep(0.01)
"""


@pytest.mark.timeout(60)
def test_sigkill_loses_at_most_the_last_second(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)])
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            files = list(tmp_path.glob("events-*.jsonl"))
            if files and '"save"' in files[0].read_text():
                break
            time.sleep(0.05)
        else:
            pytest.fail("the child recorded no save")
        time.sleep(1.5)
        killed_at = time.time()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    events = lines(files[0])
    steps = [e["step"] for e in events if e["kind"] == "train_step"]
    assert steps == list(range(len(steps)))  # nothing torn, nothing out of order
    assert any(e["kind"] == "save" and e["step"] == 20 for e in events)
    assert killed_at - events[-1]["t"] < 0.5 + 0.3  # flush interval + scheduling slack
    report = build_report(tmp_path)  # a killed writer's file still makes a report
    assert report.attempts == 1 and report.checkpoints.saves == 1


EXIT_WITHOUT_CLOSE = """
import sys
from incluster.goodput.events import EventRecorder
rec = EventRecorder(sys.argv[1], rank=0, flush_interval_s=3600)
for i in range(100):
    rec.record("train_step", step=i)
"""


def test_a_process_that_exits_without_close_still_writes_its_last_lines(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path)], check=True, timeout=60)
    (path,) = tmp_path.glob("events-*.jsonl")
    assert [e["step"] for e in lines(path)] == list(range(100))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_records_nothing_and_never_hangs_on_the_parents_lock(tmp_path: Path) -> None:
    rec = EventRecorder(tmp_path, flush_interval_s=3600)
    rec.record(ev.START, world_size=1)
    with rec._lock:  # the writer thread holds it at the moment of the fork
        pid = os.fork()
        if pid == 0:  # the child: its own lock, nothing written to the parent's file
            try:
                rec.record(ev.SAVE, step=1, blocked_s=0.0)
                rec.flush()
                rec.close()
                os._exit(0 if rec.dropped == 1 else 3)
            finally:
                os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rec.close()
    assert [e["kind"] for e in lines(rec.path)] == ["start"]


def test_alive_stops_at_a_hang_even_right_after_a_long_pause(tmp_path: Path) -> None:
    """Steps of 1 s, an evaluation of 100 s, then a step that hangs: measured from the last
    gap alone, the hang counted as training for 200 s."""
    clock = [0.0]
    rec = EventRecorder(tmp_path, clock=lambda: clock[0], flush_interval_s=0.5)  # its thread waits 0.5 s first
    for t in (1.0, 2.0, 3.0, 103.0):  # the last step begins after the evaluation
        clock[0] = t
        rec.alive()
    for t in (103.5, 104.5, 110.0, 150.0):
        clock[0] = t
        rec.flush()
    alive = [e["t"] for e in lines(rec.path) if e["kind"] == ev.ALIVE]
    # within two steps (and an interval) of the last step's start; never at 110 or 150 (the
    # recorder's own thread may add a line of an earlier clock value, when the test is slow)
    assert max(alive) == 104.5, alive
    rec.close()
