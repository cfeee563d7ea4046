"""writer/sequence.py: which steps a rank's save sequence fails, against a shared table of
"the step after P" (the job store's compare-and-set, here a dict)."""

from __future__ import annotations

import pytest

from incluster.errors import CheckpointError
from incluster.writer.sequence import CLOSED, EXITED, SaveSequence, SkippedByOthers, leave


class Job:
    def __init__(self) -> None:
        self.after: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.failed: dict[int, str] = {}

    def rank(self, r: int) -> tuple[SaveSequence, list[int]]:
        exchanged: list[int] = []
        seq = SaveSequence(r, lambda t, p, s, n: self.after.setdefault((t, p), (s, n, r)),
                           lambda s, why: self.failed.setdefault(s, why), lambda s, timeline: exchanged.append(s))
        return seq, exchanged

    def successor(self, timeline: int, prev: int, step: int, number: int) -> tuple[int, int, int]:
        """As a rank that does not say which it is (a CLOSED/EXITED mark names it in ``number``)."""
        return self.after.setdefault((timeline, prev), (step, number, -1))


def run(seq: SaveSequence, steps: list[int], timeline: int = 0) -> dict[int, str]:
    """Save ``steps`` in order (the trainer's count of calls as ordinal); each verdict."""
    out, prev = {}, -1
    for n, step in enumerate(steps):
        try:
            seq.check(step, prev, n, timeline)
            out[step] = f"ok {seq.ordinal}"
        except SkippedByOthers as exc:
            out[step] = str(exc)
        prev = step
    return out


def test_ranks_that_save_the_same_steps_agree_and_number_them_alike():
    job = Job()
    (a, xa), (b, xb) = job.rank(0), job.rank(1)
    assert run(a, [2, 4, 6]) == run(b, [2, 4, 6]) == {2: "ok 0", 4: "ok 1", 6: "ok 2"}
    assert job.failed == {} and xa == xb == []


@pytest.mark.parametrize("skipper_first", [True, False])
def test_a_skipped_step_fails_for_everyone_and_the_numbers_stay_alike(skipper_first):
    job = Job()
    (a, xa), (b, xb) = job.rank(0), job.rank(1)
    full, short = [2, 4, 5, 8, 10], [2, 8, 10]  # rank 1 skips 4 and 5
    if skipper_first:
        vb, va = run(b, short), run(a, full)
    else:
        va, vb = run(a, full), run(b, short)
    assert vb[8] == va[8] and va[10] == vb[10], (va, vb)  # same numbers for the common steps
    if skipper_first:  # rank 1 got to "after 2" first: rank 0's 4 and 5 are the odd ones
        assert "rank 1 saved step 8, not step 4" in va[4] and "which rank 1 (and maybe others) did not" in va[4]
        assert "not step 5" in va[5]
        assert va[8] == "ok 1" and job.failed == {} and xb == []
    else:  # rank 0 got there first: rank 1 finds it skipped 4, then 5, fails both, takes part in their exchange
        assert set(job.failed) == {4, 5} and xb == [4, 5] and "rank 1 did not save step 4" in job.failed[4]
        assert va[8] == "ok 3"
    assert xa == []


def test_an_extra_step_fails_only_itself_and_the_next_is_checked_from_before_it():
    job = Job()
    (a, _), (b, xb) = job.rank(0), job.rank(1)
    run(a, [2, 4, 6])
    vb = run(b, [2, 3, 4, 5, 6])  # 3 and 5 are rank 1's alone
    assert isinstance(SkippedByOthers("x"), CheckpointError)
    assert "not step 3" in vb[3] and "not step 5" in vb[5] and vb[4] == "ok 1" and vb[6] == "ok 2", vb
    assert job.failed == {} and xb == []


def test_checking_a_step_again_gives_its_verdict_and_moves_nothing():
    job = Job()
    (a, _), (b, _) = job.rank(0), job.rank(1)
    run(a, [2, 4])
    b.check(2, -1, 0)
    with pytest.raises(SkippedByOthers):
        b.check(3, 2, 1)
    with pytest.raises(SkippedByOthers):
        b.check(3, 2, 1)  # the commit failed, then its exchange asks again: same verdict
    b.check(4, 3, 2)
    assert b.pos == 4 and b.ordinal == 1


def test_a_step_that_reaches_the_writer_late_gets_no_verdict_and_moves_nothing():
    """A refused save's failure overtaking the previous step's commit walked from the
    wrong place and failed a step every rank saved (now the refusal is sent behind the
    staging; a late step is left alone if it happens anyway)."""
    job = Job()
    (a, _), (b, _) = job.rank(0), job.rank(1)
    run(b, [10, 20, 30])
    a.check(10, -1, 0)
    a.check(30, 20, 2)  # before 20: the walk from 10 finds 20, which a did save...
    assert job.failed == {20: "rank 0 did not save step 20: after step 10, it saved step 30 (every rank must "
                              "save the same steps)"}  # ...this is what a late step costs: hence the ordering
    job2 = Job()
    (c, _), (d, _) = job2.rank(0), job2.rank(1)
    run(d, [10, 20, 30])
    c.check(10, -1, 0)
    c.check(20, 10, 1)
    c.check(30, 20, 2)
    assert c.check(20, 10, 1) is False and c.pos == 30 and c.ordinal == 2 and job2.failed == {}


def test_the_number_comes_from_the_rank_that_got_there_first_even_for_a_new_writer():
    job = Job()
    (a, _), (b, _) = job.rank(0), job.rank(1)
    run(a, [2, 4, 6, 8])
    fresh, _ = job.rank(1)  # rank 1's writer was started again; its trainer counted 7 calls (some refused)
    fresh.check(6, 4, 7)
    assert fresh.ordinal == 2  # the sequence's number, not the trainer's count
    fresh.check(8, 6, 8)
    assert fresh.ordinal == 3


@pytest.mark.parametrize("closer_first", [True, False])
def test_a_rank_that_closes_without_the_last_save_fails_it_for_the_others(closer_first):
    """Rank 1 skips the last save and closes: rank 0's step 4 waited for it, then failed
    on a closed gloo pair, blaming rank 0 and a crash."""
    job = Job()
    (a, _), (b, _) = job.rank(0), job.rank(1)
    b.check(2, -1, 0)
    a.check(2, -1, 0)
    if closer_first:
        b.close()
        with pytest.raises(SkippedByOthers, match="rank 1 closed its Checkpointer after step 2 and saves no more: step 4 is not saved by every rank"):
            a.check(4, 2, 1)
        assert job.failed == {}
    else:
        a.check(4, 2, 1)
        b.close()
        assert job.failed == {4: "rank 1 closed its Checkpointer after step 2 and saves no more: step 4 is not saved "
                                 "by every rank"}
    a.close()  # after its own last step: nothing to fail
    assert set(job.failed) <= {4}


@pytest.mark.parametrize("leaver_first", [True, False])
def test_a_rank_that_leaves_before_any_save_fails_the_others_first_save(leaver_first):
    """Rank 1 left (close(), or an exception with nothing in flight) before it saved a
    step since the timeline began: its writer saw no save, so only its trainer can mark
    the end, and the others' first save waited slot_timeout_s for its copy."""
    job = Job()
    a, _ = job.rank(0)

    def rank_1_leaves() -> None:
        leave(job.successor, lambda s, why: job.failed.setdefault(s, why), 1, 0, -1, EXITED)

    if leaver_first:
        rank_1_leaves()
        with pytest.raises(SkippedByOthers, match=r"rank 1 exited without close\(\) \(its training code raised\?\) without saving a step since it started or "
                                                     r"since its last load\(\) and saves no more: step 5 is not saved"):
            a.check(5, -1, 0)
        assert job.failed == {}
    else:
        a.check(5, -1, 0)
        rank_1_leaves()
        assert job.failed[5].startswith("rank 1 exited without close() (its training code raised?) without saving a step")
    leave(job.successor, lambda s, why: job.failed.setdefault(s, why), 1, 0, -1, CLOSED)  # marked again: nothing new
    assert list(job.failed) in ([], [5])


def test_after_a_load_the_same_step_numbers_start_a_new_sequence():
    """Saves 10, 20, 30, then load() restores 10 and the ranks save 15, 20, 25: the old
    "after 20 came 30" must not fail step 25 on every rank."""
    job = Job()
    (a, _), (b, _) = job.rank(0), job.rank(1)
    run(a, [10, 20, 30])
    run(b, [10, 20, 30])
    assert run(a, [15, 20, 25], timeline=1) == run(b, [15, 20, 25], timeline=1) == {15: "ok 0", 20: "ok 1", 25: "ok 2"}
    assert job.failed == {}


def test_a_step_skipped_after_a_load_is_exchanged_in_the_timeline_it_was_saved_in():
    """The skipper's empty exchange of step 3 (saved after the ranks' first load()) used
    the keys of the writer's last commit, of the timeline before, when the skipper's
    first act after the load was to publish a failure."""
    job = Job()
    told: list[tuple[int, int]] = []
    a, _ = job.rank(0)
    b = SaveSequence(1, job.successor, lambda s, why: job.failed.setdefault(s, why),
                     lambda s, timeline: told.append((s, timeline)))
    run(a, [1, 2])
    run(b, [1, 2])
    run(a, [3, 4], timeline=1)
    run(b, [4], timeline=1)  # skips 3
    assert told == [(3, 1)] and "rank 1 did not save step 3" in job.failed[3]
