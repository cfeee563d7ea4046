"""Writers that re-pair after a broken exchange meet again, whoever repairs first."""

from __future__ import annotations

import threading
import time

import pytest

from incluster.commit import host_store
from incluster.replication import Replicator


class _NoCoord:
    def failed(self, step: int, why: str) -> None:
        pass


@pytest.fixture()
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    server, addr = host_store("repair", world_size=2)
    reps: list = [None, None]

    def make(r: int) -> None:
        reps[r] = Replicator(addr, r, 2, (1 - r,), (1 - r,), local_dir=str(tmp_path), job="repair",
                             node=f"n{r}", keep=2, timeout_s=3.0)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    yield reps
    del server


def test_partners_that_repair_at_different_times_pair_again(pair):
    """Rank 0's exchange broke first and it goes straight on to its next one, reading rank
    1's old incarnation; rank 1 repairs a moment later. Both must meet on one pairing
    (each waiting on a key named by the other's stale incarnation failed every later step,
    each failure a new repair)."""
    a, b = pair
    out: dict = {}

    def run(rep, name: str) -> None:
        for step in (6, 8, 10):
            try:
                rep.exchange(step, None, _NoCoord())
                out[(name, step)] = "ok"
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                out[(name, step)] = repr(exc)[:200]

    a._repair(RuntimeError("rank 0's exchange broke"))
    ta = threading.Thread(target=run, args=(a, "a"))
    ta.start()
    time.sleep(0.05)
    b._repair(RuntimeError("rank 1's exchange broke later"))
    tb = threading.Thread(target=run, args=(b, "b"))
    tb.start()
    ta.join(60)
    tb.join(60)
    assert all(v == "ok" for v in out.values()) and len(out) == 6, out
    assert a.incarnation == b.incarnation == 1 << 32  # one repair each, no more


def test_a_first_writer_stops_at_once_naming_why_when_its_partner_did_not_start(tmp_path, monkeypatch):
    """Rank 1's Checkpointer() failed (a refused folder) and said so in the job store:
    rank 0's first writer must stop now, naming that reason, not wait out the pairing's
    whole timeout and then blame a rendezvous key."""
    from incluster.replication import announce_writer

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    server, addr = host_store("gone", world_size=2)
    announce_writer(addr, "gone", 1, "gone", why="rank 1's Checkpointer() failed: refused")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="partner rank 1 did not start: rank 1's Checkpointer.. failed: refused"):
        Replicator(addr, 0, 2, (1,), (1,), local_dir=str(tmp_path), job="gone", node="n0", keep=2, timeout_s=60.0)
    assert time.monotonic() - t0 < 30  # far inside the 60 s the pairing would have waited
    del server


def test_a_broken_exchange_names_the_partner_rank(pair):
    """gloo's error names only an address: the survivor's error, read alone, blamed it."""
    a, b = pair
    paired = threading.Thread(target=b._refresh_pairs, args=(4,))  # both meet the pairing...
    paired.start()
    a._refresh_pairs(4)
    paired.join(10)
    b.close()  # ...then rank 1's writer goes, before the exchange
    with pytest.raises(RuntimeError, match="with partner rank 1"):
        a.exchange(4, None, _NoCoord())
