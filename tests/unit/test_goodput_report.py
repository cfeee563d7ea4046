"""goodput.report: accounting of hand-built runs, checked against hand-computed seconds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from incluster.goodput.report import build_report, percentile, read_run

GIB = 1 << 30


def write(run: Path, rank: int, pid: int, events: list[tuple], torn: str | None = None) -> None:
    """events: (t, kind, fields)."""
    lines = [json.dumps({"t": t, "kind": k, "rank": rank, "pid": pid, **f}) for t, k, f in events]
    text = "".join(line + "\n" for line in lines) + (torn or "")
    (run / f"events-rank{rank:05d}-pid{pid}.jsonl").write_text(text)


def steps(first: int, times: list[float]) -> list[tuple]:
    return [(t, "train_step", {"step": first + i}) for i, t in enumerate(times)]


@pytest.fixture
def two_rank_run(tmp_path: Path) -> Path:
    """Two ranks, one failure at ~t=23, restart from step 4 (see the hand accounting below)."""
    write(tmp_path, 0, 100, [
        (0, "start", {"world_size": 2}),
        (10, "load", {"step": None, "source": "none", "bytes": 0, "seconds": 2}),
        *steps(0, [11, 12, 13, 14, 15]),
        (15.5, "save", {"step": 4, "blocked_s": 0.5}),
        (15.6, "staged", {"step": 4, "seconds": 0.3}),
        (16, "durable", {"step": 4, "tier": "local", "seconds": 1.0}),
        *steps(5, [17, 18]),
        (19, "durable", {"step": 4, "tier": "persistent", "seconds": 4.0}),
        *steps(7, [20]),
        (20.25, "save", {"step": 7, "blocked_s": 0.25}),
        (20.4, "staged", {"step": 7, "seconds": 0.2}),
        *steps(8, [21, 23]),
    ], torn='{"t": 24, "kind": "train_st')
    write(tmp_path, 0, 200, [
        (30, "start", {"world_size": 2}),
        (35, "load", {"step": 4, "source": "replica", "bytes": GIB, "seconds": 3}),
        *steps(5, [36, 37, 38, 39, 40]),
        (40.5, "save", {"step": 9, "blocked_s": 0.5}),
        (41, "durable", {"step": 9, "tier": "local", "seconds": 0.75}),
        (45, "end", {}),
    ])
    write(tmp_path, 1, 101, [
        (1, "start", {"world_size": 2}),
        (10, "load", {"step": None, "source": "none", "bytes": 0, "seconds": 1.5}),
        *steps(0, [11, 12, 13, 14, 15]),
        (15.5, "save", {"step": 4, "blocked_s": 0.5}),
        *steps(5, [17, 18, 20]),
        (20.25, "save", {"step": 7, "blocked_s": 0.25}),
        *steps(8, [21]),
        (22, "durable", {"step": 7, "tier": "local", "seconds": 1.75}),
    ])
    write(tmp_path, 1, 201, [
        (30.5, "start", {"world_size": 2}),
        (34, "load", {"step": 4, "source": "local", "bytes": GIB, "seconds": 2.5}),
        *steps(5, [36, 37, 38, 39, 40]),
        (40.5, "save", {"step": 9, "blocked_s": 0.75}),
        (44, "end", {}),
    ])
    return tmp_path


def test_two_rank_run_accounting(two_rank_run: Path) -> None:
    r = build_report(two_rank_run)
    assert (r.ranks, r.attempts, r.truncated_files) == (2, 2, 1)
    assert r.wall_s == 45
    # rank 0: save .5+.25+.5; load 2+3; restart (10-0-2) + (35-30-3) + gap (30-23);
    #         lost: held step 4 at t=15, died at 23, minus saves blocked in between (.75).
    assert r.per_rank[0] == pytest.approx({
        "checkpoint_save": 1.25, "checkpoint_load": 5, "restart": 17, "lost_progress": 7.25,
        "other": 0, "goodput": 14.5})
    # rank 1: restart (10-1-1.5) + (34-30.5-2.5) + (30.5-22); lost 22-15-.75;
    #         other: starts 1 s late and ends 1 s early.
    assert r.per_rank[1] == pytest.approx({
        "checkpoint_save": 1.5, "checkpoint_load": 4, "restart": 17, "lost_progress": 6.25,
        "other": 2, "goodput": 14.25})
    assert r.badput_s == pytest.approx({"checkpoint_save": 1.375, "checkpoint_load": 4.5,
                                        "lost_progress": 6.75, "restart": 17, "other": 1})
    assert r.goodput_s == pytest.approx(14.375)
    assert r.goodput_pct == pytest.approx(100 * 14.375 / 45)
    assert sum(r.badput_pct.values()) + r.goodput_pct == pytest.approx(100)


def test_a_restart_that_got_the_same_pid_is_still_a_restart(two_rank_run: Path) -> None:
    """A container's process gets the same pid after a restart, and older event files
    were named by pid alone: both processes' events in one file. They were one attempt,
    the failure unseen (goodput 99%). A ``start`` after events with no ``end`` (or one of
    another ``proc``) opens a new attempt."""
    before = build_report(two_rank_run).per_rank[0]
    first, second = (two_rank_run / f"events-rank00000-pid{p}.jsonl" for p in (100, 200))
    kept = first.read_text().rsplit("\n", 1)[0] + "\n"  # without the torn last line
    first.write_text(kept + second.read_text().replace('"pid": 200', '"pid": 100'))
    second.unlink()
    r = build_report(two_rank_run)
    assert r.attempts == 2 and r.per_rank[0] == pytest.approx(before)


def test_checkpointers_one_after_another_in_one_process_are_one_attempt(tmp_path: Path) -> None:
    """Lightning makes a Checkpointer per fit(): one process, one file, one attempt; a
    ``start`` of another process token in the same file is another attempt."""
    write(tmp_path, 0, 7, [(0, "start", {"proc": "a"}), (1, "save", {"step": 1, "blocked_s": 0}), (2, "end", {}),
                           (3, "start", {"proc": "a"}), (4, "save", {"step": 2, "blocked_s": 0}), (5, "end", {})])
    assert [len(a) for a in read_run(tmp_path).values()] == [1]
    write(tmp_path, 0, 7, [(0, "start", {"proc": "a"}), (1, "save", {"step": 1, "blocked_s": 0}), (2, "end", {}),
                           (3, "start", {"proc": "b"}), (4, "save", {"step": 2, "blocked_s": 0}), (5, "end", {})])
    assert [len(a) for a in read_run(tmp_path).values()] == [2]


def test_a_relaunch_after_a_clean_end_is_not_restart_time(tmp_path: Path) -> None:
    """A finished job relaunched later to train further: the time in between waited on
    no failure (it counted as restart: 92% of the window in a trial)."""
    write(tmp_path, 0, 1, [(0, "start", {}), (1, "load", {"step": None, "seconds": 0}), *steps(0, [2, 3]),
                           (4, "end", {})])
    write(tmp_path, 0, 2, [(100, "start", {}), (101, "load", {"step": 1, "seconds": 0}), *steps(2, [102, 103]),
                           (104, "end", {})])
    r = build_report(tmp_path)
    assert r.per_rank[0]["restart"] == pytest.approx(2) and r.per_rank[0]["other"] == pytest.approx(96)


def test_a_negative_or_endless_duration_is_refused_and_an_empty_file_left_out(tmp_path: Path) -> None:
    write(tmp_path, 0, 1, [(0, "start", {}), (1, "save", {"step": 1, "blocked_s": -100}), (2, "end", {})])
    with pytest.raises(ValueError, match=r"pid1.jsonl:2: damaged event line \(blocked_s -100"):
        build_report(tmp_path)
    write(tmp_path, 0, 1, [(0, "start", {}), (1, "save", {"step": 1, "blocked_s": 0.5}), (2, "end", {})])
    (tmp_path / "events-rank00001-pid9.jsonl").write_text("")  # killed before its first write
    r = build_report(tmp_path)
    assert r.ranks == 1 and r.empty_files == [str(tmp_path / "events-rank00001-pid9.jsonl")]


def test_after_a_restart_into_fewer_ranks_the_gone_ranks_work_is_still_lost_progress(tmp_path: Path) -> None:
    """Two ranks, a node lost, the job goes on with one rank that restores step 4. Rank 1
    has no later attempt of its own number: its redone work went uncounted and it was
    reported as still at risk, though the restart had settled it."""
    for rank in (0, 1):
        write(tmp_path, rank, 10 + rank, [
            (0, "start", {"world_size": 2}), (1, "load", {"step": None, "seconds": 0}),
            *steps(0, [2, 3, 4, 5, 6]),
            (6, "save", {"step": 4, "blocked_s": 0}), (6.5, "durable", {"step": 4, "tier": "global"}),
            *steps(5, [7, 8, 9]), (10, "alive", {}),
        ])
    write(tmp_path, 0, 20, [(20, "start", {"world_size": 1}), (21, "load", {"step": 4, "seconds": 1}),
                            *steps(5, [22, 23]), (24, "end", {})])
    r = build_report(tmp_path)
    assert r.per_rank[1]["lost_progress"] == pytest.approx(r.per_rank[0]["lost_progress"]) == pytest.approx(4)
    assert r.unfinished == {}


def test_checkpoint_statistics(two_rank_run: Path) -> None:
    c = build_report(two_rank_run).checkpoints
    assert (c.saves, c.save_failures, c.loads) == (6, 0, 4)
    # blocked: .25 .25 .5 .5 .5 .75 -> p50 at position 2.5, p99 at 4.95
    assert c.blocked_p50_s == pytest.approx(0.5)
    assert c.blocked_p99_s == pytest.approx(0.5 + 0.95 * 0.25)
    assert c.staged_p50_s == pytest.approx(0.25)
    assert c.durable["local"] == pytest.approx(
        {"count": 3, "p50_s": 1.0, "p99_s": 1.0 + 0.98 * 0.75})
    assert c.durable["persistent"] == pytest.approx({"count": 1, "p50_s": 4.0, "p99_s": 4.0})
    assert c.load_bytes == 2 * GIB
    assert c.load_p50_s == pytest.approx(2.25)  # 1.5 2 2.5 3
    assert c.load_sources == {"none": 2, "replica": 1, "local": 1}


def test_report_is_json_serialisable(two_rank_run: Path) -> None:
    d = json.loads(json.dumps(build_report(two_rank_run).to_dict()))
    assert d["goodput_pct"] == pytest.approx(100 * 14.375 / 45)
    assert d["per_rank"]["1"]["other"] == 2
    assert d["checkpoints"]["durable"]["local"]["count"] == 3


def test_restart_from_scratch_loses_everything_after_the_first_step(tmp_path: Path) -> None:
    write(tmp_path, 0, 1, [
        (0, "start", {"world_size": 1}),
        *steps(0, [2, 3]),
        (3.5, "save", {"step": 1, "blocked_s": 0.5}),
        *steps(2, [4.5, 5.5]),
    ])
    write(tmp_path, 0, 2, [
        (10, "start", {"world_size": 1}),
        (12, "load", {"step": None, "source": "none", "bytes": 0, "seconds": 1}),
        *steps(0, [13, 14]),
        (20, "end", {}),
    ])
    r = build_report(tmp_path)
    # init 2 (no load: the first step counts as initialisation) + (12-10-1) + gap 4.5;
    # lost: from the first progress (t=2) to 5.5, minus 0.5 blocked.
    assert r.badput_s == pytest.approx({"checkpoint_save": 0.5, "checkpoint_load": 1,
                                        "lost_progress": 3.0, "restart": 7.5, "other": 0})
    assert r.goodput_s == pytest.approx(8)


def test_falling_back_to_an_older_step_loses_two_attempts(tmp_path: Path) -> None:
    write(tmp_path, 0, 1, [(0, "start", {}), (1, "load", {"step": None, "seconds": 0}),
                           *steps(0, [2, 3, 4, 5, 6, 7, 8, 9, 10, 11])])  # steps 0..9
    write(tmp_path, 0, 2, [(20, "start", {}), (21, "load", {"step": 9, "seconds": 1}),
                           *steps(10, [22, 23, 24])])
    write(tmp_path, 0, 3, [(30, "start", {}), (32, "load", {"step": 4, "seconds": 2}),
                           *steps(5, [33, 34]), (40, "end", {})])
    r = build_report(tmp_path)
    # attempt 1 held step 4 at t=6 and died at 11: 5 s lost; attempt 2 never held a
    # step <= 4, so everything from its load (t=21) to its death (t=24) is lost: 3 s.
    assert r.badput_s["lost_progress"] == pytest.approx(8)
    # restart: (1-0-0) + (21-20-1) + (32-30-2) + gaps (20-11) + (30-24)
    assert r.badput_s["restart"] == pytest.approx(1 + 0 + 0 + 9 + 6)
    assert r.badput_s["checkpoint_load"] == pytest.approx(3)
    # kept: attempt 1 from its load to step 4 (t=1..6), attempt 3 from its load (32..40)
    assert r.goodput_s == pytest.approx(5 + 8) == 40 - 8 - 16 - 3


def test_a_last_attempt_without_end_shows_the_work_a_restart_would_lose(tmp_path: Path) -> None:
    """Read right after a crash, before any restart: nothing is lost progress yet (no
    load says what was restored), and the report said 99 % goodput with no word more.
    Now each rank whose last process has no end shows the work since its newest durable
    step; the rendered report says it."""
    import io

    from rich.console import Console

    from incluster.goodput.report import render

    write(tmp_path, 0, 1, [(0, "start", {}), (1, "load", {"step": None, "seconds": 0}),
                           *steps(0, [2, 3, 4]),
                           (4.5, "save", {"step": 2, "blocked_s": 0.5}),
                           (5, "durable", {"step": 2, "tier": "global", "seconds": 1}),
                           *steps(3, [5.5, 6.5]),
                           (7, "save", {"step": 4, "blocked_s": 0.25}),  # never durable
                           *steps(5, [8, 9]), (9.4, "alive", {})])
    write(tmp_path, 1, 2, [(0, "start", {}), *steps(0, [2, 3]), (9.4, "end", {})])
    r = build_report(tmp_path)
    # held step 2 at t=4; both saves' blocked time after that stays save time
    assert r.unfinished == pytest.approx({0: 9.4 - 4 - 0.5 - 0.25})
    assert r.badput_s["lost_progress"] == 0
    out = io.StringIO()
    render(r, Console(file=out, width=300))
    assert "rank 0: the last process recorded no end (killed, or still running, or it never called" in out.getvalue()
    assert "4.65 s since its newest durable step" in out.getvalue()
    assert json.loads(json.dumps(r.to_dict()))["unfinished"] == {"0": pytest.approx(4.65)}


def test_at_risk_counts_from_a_step_every_rank_holds(tmp_path: Path) -> None:
    """Several ranks: a step durable on this rank only ("local") is no step a restart can
    go back to; the work at risk runs from the newest "global" one."""
    write(tmp_path, 0, 1, [(0, "start", {}), (1, "load", {"step": None, "seconds": 0}),
                           *steps(0, [2, 3, 4, 5]),
                           (3, "save", {"step": 1, "blocked_s": 0}), (3.5, "durable", {"step": 1, "tier": "global"}),
                           (5, "save", {"step": 3, "blocked_s": 0}), (5.5, "durable", {"step": 3, "tier": "local"}),
                           (8, "alive", {})])
    assert build_report(tmp_path).unfinished == pytest.approx({0: 8 - 3})
    write(tmp_path, 0, 1, [(0, "start", {"world_size": 2}), (1, "load", {"step": None, "seconds": 0}),
                           *steps(0, [2, 3, 4, 5]),
                           (5, "save", {"step": 3, "blocked_s": 0}), (5.5, "durable", {"step": 3, "tier": "local"}),
                           (8, "alive", {})])  # a peer died before any step became global
    assert build_report(tmp_path).unfinished == pytest.approx({0: 8 - 1})


def test_damaged_middle_line_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "events-rank00000-pid7.jsonl").write_text(
        '{"t": 0, "kind": "start"}\nnot json\n{"t": 2, "kind": "end"}\n')
    with pytest.raises(ValueError, match=r"pid7.jsonl:2: damaged"):
        build_report(tmp_path)


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    (tmp_path / "events-rank00002-pid7.jsonl").write_text(
        '{"t": 0, "kind": "start"}\n{"t": 5, "kind": "end"}')
    runs = read_run(tmp_path)
    (attempt,) = runs[2]
    assert (attempt.pid, attempt.last_t, attempt.ended, attempt.truncated) == (7, 5, True, False)


def test_empty_folder_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no events"):
        build_report(tmp_path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.floats(0, 100))
def test_percentile_matches_numpy(xs: list[float], q: float) -> None:
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None


def test_close_time_is_save_time_once_even_inside_a_window_of_lost_work(tmp_path: Path) -> None:
    """An attempt whose close() drained for 28 s, then a restart back to its last save: the
    28 s were counted as checkpoint save and again as lost progress."""
    write(tmp_path, 0, 1, [(0, "start", {}), (1, "load", {"step": None, "seconds": 0}), *steps(0, [2, 3]),
                           (3.5, "save", {"step": 1, "blocked_s": 0}), *steps(2, [4, 5]),
                           (33, "end", {"seconds": 28})])
    write(tmp_path, 0, 2, [(40, "start", {}), (41, "load", {"step": 1, "seconds": 1}), *steps(2, [42, 43]),
                           (44, "end", {"seconds": 0})])
    acc = build_report(tmp_path).per_rank[0]
    assert acc["checkpoint_save"] == pytest.approx(28)
    assert acc["lost_progress"] == pytest.approx(33 - 3.5 - 28)  # from its save of step 1 to its end, less close()


def test_saves_given_up_for_a_newer_one_are_not_counted_as_failures(tmp_path: Path) -> None:
    """A save superseded while the writer process started (on this rank, or told by
    another) is counted apart: no step could be durable before that start."""
    write(tmp_path, 0, 1, [
        (0, "start", {}),
        *[(0.1 * s, "save", {"step": s, "blocked_s": 0.001}) for s in (1, 2, 3, 4)],
        (1, "save_failed", {"step": 1, "error": "step 1 was not saved (superseded ...)", "superseded": True}),
        (2, "save_failed", {"step": 2, "error": "the RAM disk is full"}),
        (3, "end", {}),
    ])
    c = build_report(tmp_path).checkpoints
    assert (c.saves, c.save_failures, c.save_superseded) == (4, 1, 1)
