"""The job store's per-step outcome: every rank reaches the same verdict, whatever the timing."""

from __future__ import annotations

import pytest

from incluster.commit import StoreCoordinator, host_store
from incluster.errors import CommitError, PeerTimeoutError


@pytest.fixture()
def two_ranks(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    server, addr = host_store("outcome-test", world_size=2)
    ranks = [StoreCoordinator(addr, r, timeout=10) for r in range(2)]
    yield ranks
    for c in ranks:
        c.close()
    del server


def test_a_rank_that_gives_up_waiting_fails_the_step_for_the_late_rank_too(two_ranks):
    """Rank 1 saves step 5 later than rank 0 waits: rank 0 gives up. Rank 1's commit must
    then not make step 5 durable on rank 1 alone - on a restart, rank 0's copy would be
    gone and rank 1's the newest, so no step would have every rank's shard."""
    r0, r1 = two_ranks
    r0.committed(5)
    with pytest.raises(PeerTimeoutError, match="not committed by every rank within"):
        r0.wait_outcome(5, timeout=0.5)
    r1.committed(5)  # late: the count reaches the quorum after the verdict
    with pytest.raises(CommitError, match="step 5 failed on rank 0 .*timed out waiting"):
        r1.wait_outcome(5, timeout=5)
    assert not r1.store.check(["incluster/outcome-test/latest"])  # no rank counts step 5 as the newest


def test_commits_in_time_are_durable_for_every_rank(two_ranks):
    r0, r1 = two_ranks
    r0.committed(7)
    r1.committed(7)
    r0.wait_outcome(7, timeout=5)
    r1.wait_outcome(7, timeout=5)
    assert r0.store.get("incluster/outcome-test/latest").decode() == "7"


def test_a_dead_writers_step_is_settled_complete_when_every_copy_was_counted(two_ranks):
    """Rank 1's writer counted the last copy of step 9 and died before publishing it:
    every copy is committed, so the step is complete for every rank, not failed."""
    r0, r1 = two_ranks
    r0.committed(9)
    r1.store.add("incluster/outcome-test/c/9", 1)  # the dead writer's count, without its compare-and-set
    assert r1.settle(9, "writer died") == "ok"
    r0.wait_outcome(9, timeout=5)
    assert r0.store.get("incluster/outcome-test/latest") == b"9"


def test_a_dead_writers_step_missing_copies_is_failed_for_every_rank(two_ranks):
    r0, r1 = two_ranks
    r0.committed(11)
    assert r1.settle(11, "writer died").startswith("fail:1:writer died")
    r1.committed(11)  # a late count cannot make it durable any more
    with pytest.raises(CommitError, match="step 11 failed on rank 1 .*writer died"):
        r0.wait_outcome(11, timeout=5)
