"""The job store's per-step outcome: every rank reaches the same verdict, whatever the timing."""

from __future__ import annotations

import os

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


def test_a_step_number_saved_again_after_a_load_is_decided_by_its_own_commits(two_ranks):
    """Step 7 is durable; a load() goes back past it (every copy of it lost) and the ranks
    save a step 7 again. That one is a new step: one rank's commit does not complete it,
    one rank's failure fails it, and the first step 7's verdict stands as it was."""
    r0, r1 = two_ranks
    for r in (r0, r1):
        r.committed(7)
    r0.wait_outcome(7, timeout=5)
    again0, again1 = r0.at(1), r1.at(1)  # after the ranks' first load()
    again0.committed(7)
    with pytest.raises(PeerTimeoutError, match="1 of 2 copies committed"):
        again0.wait_outcome(7, timeout=0.5)  # read under the first step 7's keys: "ok" at once
    assert again1.failed(7, "save() raised on rank 1").startswith("fail:0:")  # rank 0 gave up first
    r0.wait_outcome(7, timeout=5)  # the first one stays durable
    for r in (r0, r1):  # and the keys of every later load() are apart again
        r.at(2).committed(7)
    r1.at(2).wait_outcome(7, timeout=5)


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


def test_an_upload_failing_on_one_rank_fails_it_on_every_rank_at_once(two_ranks, tmp_path):
    """Rank 1's store refuses its shard: rank 0, whose shard is uploaded, must learn at
    once that the step will have no manifest, not wait timeout_s (600 s by default) for a
    count that never completes, with its slot pinned and later uploads skipped."""
    import queue
    import time

    from incluster.persist import PersistParams, Uploader
    from incluster.testing.tiers import FaultyTier
    from incluster.tiers.persistent import FsspecTier

    root = str(tmp_path / "persist")
    tiers = [FsspecTier(root), FaultyTier(FsspecTier(root), ops=("write",))]
    words: queue.Queue = queue.Queue()
    for rank, (coord, tier) in enumerate(zip(two_ranks, tiers)):
        up = Uploader(PersistParams(url=tier, job="j", rank=rank, world_size=2, retries=1, timeout_s=120), coord)
        up.loaded = True
        sidecar = b'{"checksum": "00"}'
        assert up.start(3, sidecar, bytearray(64), 64, lambda err, rank=rank: words.put((rank, err)))
    t0 = time.monotonic()
    told = dict(words.get(timeout=30) for _ in range(2))
    assert time.monotonic() - t0 < 15
    assert "refused write" in told[1] and told[0].startswith("rank 1: ")
    assert not os.path.exists(os.path.join(root, "j", "step-000000000003", "COMMITTED.json"))


def test_a_step_uploaded_again_after_a_load_gets_its_own_manifest(two_ranks, tmp_path):
    """Step 3 was uploaded; a load() went back past it and the ranks upload a step 3 again.
    Counted under the first one's keys, the count passed the world size without ever
    equalling it: no manifest, and every rank read the first upload's "ok"."""
    import json as _json
    import queue

    from incluster.persist import PersistParams, Uploader
    from incluster.tiers.persistent import FsspecTier

    root = tmp_path / "persist"
    manifest = root / "j" / "step-000000000003" / "COMMITTED.json"
    for timeline, fill in ((0, b"A"), (1, b"B")):
        words: queue.Queue = queue.Queue()
        for rank, coord in enumerate(two_ranks):
            up = Uploader(PersistParams(url=FsspecTier(str(root)), job="j", rank=rank, world_size=2, timeout_s=60),
                          coord)
            up.loaded = timeline > 0
            sidecar = _json.dumps({"checksum": f"{timeline}{rank}"}).encode()
            up.start(3, sidecar, bytearray(fill * 64), 64, lambda err, rank=rank: words.put((rank, err)), timeline)
        told = dict(words.get(timeout=30) for _ in range(2))
        assert told == {0: None, 1: None}, told
        ranks = _json.loads(manifest.read_text())["ranks"]
        assert [r["checksum"] for r in ranks] == [f"{timeline}0", f"{timeline}1"], ranks
    assert (root / "j" / "step-000000000003" / "rank-00001.safetensors").read_bytes() == b"B" * 64


def test_no_rank_writes_a_step_before_rank_0_found_it_free(two_ranks, tmp_path):
    """A new run that never called load() saves step 3, which the tier holds from an
    earlier run: rank 0 refuses it, and rank 1 must not have overwritten its shard of
    that manifested step meanwhile (it wrote at once, and the step no longer verified)."""
    import json as _json

    from incluster.persist import PersistParams, Uploader
    from incluster.tiers.persistent import FsspecTier

    root = tmp_path / "persist"
    step = root / "j" / "step-000000000003"
    step.mkdir(parents=True)
    (step / "rank-00001.safetensors").write_bytes(b"A" * 64)
    (step / "COMMITTED.json").write_text(_json.dumps({"step": 3}))
    import queue

    words: queue.Queue = queue.Queue()
    for rank, coord in enumerate(two_ranks):
        up = Uploader(PersistParams(url=FsspecTier(str(root)), job="j", rank=rank, world_size=2, timeout_s=60), coord)
        up.start(3, b'{"checksum": "00"}', bytearray(b"B" * 64), 64, lambda err, rank=rank: words.put((rank, err)))
    told = dict(words.get(timeout=30) for _ in range(2))
    assert "did not call load()" in told[0] and "did not call load()" in told[1], told
    assert (step / "rank-00001.safetensors").read_bytes() == b"A" * 64


def test_a_time_based_upload_still_being_decided_at_close_never_starts(two_ranks, tmp_path):
    """With persistent_interval_s, rank 1 waits for rank 0's clock to say whether step 3
    is due. close() comes first: the step is reported as not persisted, at once, and
    when the decision arrives later (due) nothing is written from the slot that close()
    has unmapped, and rank 0 learns that step 3 gets no manifest."""
    import queue
    import time

    from incluster.persist import PersistParams, Uploader
    from incluster.tiers.persistent import FsspecTier

    root = tmp_path / "persist"
    words: queue.Queue = queue.Queue()
    decisions = StoreCoordinator(two_ranks[1].addr, 1, timeout=10)  # the writer's second client, as in service.py
    up = Uploader(PersistParams(url=FsspecTier(str(root)), job="j", rank=1, world_size=2, interval_s=1.0,
                                timeout_s=60), two_ranks[1], decisions)
    assert up.start(3, b'{"checksum": "00"}', bytearray(b"B" * 64), 64, words.put)
    assert not up.wait_idle(0.3)  # the decision is pending: close() may not unmap yet
    t0 = time.monotonic()
    why = up.cancel()
    assert time.monotonic() - t0 < 5, "cancel() queued behind the decision's wait"
    assert why is not None and "close()" in why
    assert "close()" in words.get(timeout=1)
    two_ranks[0].persist_outcome(-4, "1", 0)  # rank 0's clock: due
    time.sleep(1.0)
    assert words.empty()  # told once
    assert not (root / "j").exists() or not any((root / "j").rglob("rank-00001*"))
    assert two_ranks[0].persist_outcome(3, None, 5).startswith("fail:1:")
    assert up.wait_idle(0)
    decisions.close()


def test_close_waits_until_a_decided_steps_outcome_was_told(two_ranks, tmp_path):
    """A step rank 0 decides not due is told so while close() waits: close() may not
    return first (the trainer would report that step as cut off by close(), and the
    late report would be lost)."""
    import threading
    import time

    from incluster.persist import NOT_DUE, PersistParams, Uploader
    from incluster.tiers.persistent import FsspecTier

    told: list[str] = []

    def slow_done(why):
        time.sleep(0.3)  # a report that takes a while (a pipe send behind others)
        told.append(why)

    up = Uploader(PersistParams(url=FsspecTier(str(tmp_path / "p")), job="j", rank=1, world_size=2, interval_s=1.0,
                                timeout_s=60), two_ranks[1])
    assert up.start(3, b'{"checksum": "00"}', bytearray(64), 64, slow_done)
    threading.Timer(0.2, two_ranks[0].persist_outcome, (-4, "0", 0)).start()  # rank 0's clock: not due
    assert up.wait_idle(10)
    assert told == [NOT_DUE]
    assert up.cancel() is None


@pytest.mark.parametrize("verdict,discarded", [("ok", False), (None, False), ("fail:0:disk full", True)])
def test_a_replication_that_breaks_keeps_the_replicas_unless_the_step_failed(tmp_path, verdict, discarded):
    """Rank 0 returns from wait() on a durable step and ends, taking the job store along,
    while rank 1's exchange of that step is still updating the store after counting its
    replica: the exchange raises, but the step was durable (or, with the store gone, may
    be), so the replica of rank 0's shard held here - maybe its only copy left - stays."""
    from incluster.writer.protocol import WriterParams
    from incluster.writer.service import CommitService

    class Replicator:
        dropped: list[int] = []

        def exchange(self, step, own, coord):
            raise RuntimeError("Connection reset by peer")

        def discard(self, step):
            self.dropped.append(step)

    class Coord:
        def at(self, timeline):
            return self

        def failed(self, step, reason):
            if verdict is None:
                raise RuntimeError("Broken pipe")  # the store is gone
            return verdict

    service = CommitService(WriterParams(rank=1, gen=0, store=None, outcome_timeout_s=5, local_dir=str(tmp_path)))
    service.replicator, service.coord = Replicator(), Coord()
    with pytest.raises(RuntimeError, match="Connection reset"):
        service.replicate(3, object())
    assert Replicator.dropped == ([3] if discarded else [])


def test_a_store_lost_while_deciding_a_timed_out_step_leaves_its_outcome_unknown():
    """The wait for step 3 times out and the store goes away before this rank can publish
    the step failed: the outcome is unknown (StoreLostError: the copies stay), not a
    connection error the writer takes for a failed step (and drops its replicas for)."""
    from incluster.commit import StoreAddress
    from incluster.errors import StoreLostError

    class Store:
        def set_timeout(self, t):
            pass

        def get(self, key):
            raise RuntimeError("Wait timeout after 0.1 s")

        def add(self, key, n):
            raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    coord = object.__new__(StoreCoordinator)
    coord.addr, coord.rank, coord._p, coord._base, coord.store = StoreAddress("h", 1, "j", 2, 2), 1, "incluster/j/", "incluster/j/", Store()
    with pytest.raises(StoreLostError, match="while deciding step 3 after a timeout"):
        coord.wait_outcome(3, 0.1)
