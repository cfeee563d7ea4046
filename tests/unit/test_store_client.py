"""Clients of the job store: a live store is reached with the caller's timeout for its
calls, and a store that is gone is told from one that listens."""

from __future__ import annotations

import datetime
import socket

from incluster import store_client


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_refused_tells_a_store_that_is_gone_from_one_that_listens():
    """What a writer that died of a lost store is asked before it is left unstarted."""
    from torch.distributed import TCPStore

    assert store_client.refused("127.0.0.1", _dead_port()) is not None
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    assert store_client.refused("127.0.0.1", master.port) is None


def test_a_live_store_is_reached_with_the_callers_timeout(monkeypatch):
    from torch.distributed import TCPStore

    monkeypatch.setattr(store_client, "_lost", {})
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    client = store_client.connect("127.0.0.1", master.port, 10.0)
    client.set("k", "v")
    assert master.get("k") == b"v"
    assert client.raw.timeout == datetime.timedelta(seconds=10)
