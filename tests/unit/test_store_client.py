"""A new client of a job store whose process is gone fails at once, naming it: TCPStore
retries a refused connect for its whole timeout (60 s for a writer), then says only that
it "timed out" - a writer started after rank 0 died stalled every save for minutes."""

from __future__ import annotations

import datetime
import socket
import time

import pytest

from incluster import store_client
from incluster.errors import StoreLostError


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_a_refused_store_is_lost_at_once_not_after_the_timeout(monkeypatch):
    monkeypatch.setattr(store_client, "_lost", {})
    port = _dead_port()
    t0 = time.monotonic()
    with pytest.raises(StoreLostError, match=rf"lost the job store \(rank 0's, at 127.0.0.1:{port}: .*refused"):
        store_client.connect("127.0.0.1", port, 30.0)
    assert time.monotonic() - t0 < 5
    monkeypatch.setattr(store_client, "refused", lambda *a: pytest.fail("the lost store was tried again"))
    with pytest.raises(StoreLostError):  # remembered: the next client does not even try
        store_client.connect("127.0.0.1", port, 30.0)


def test_a_live_store_is_reached_through_the_probe(monkeypatch):
    from torch.distributed import TCPStore

    monkeypatch.setattr(store_client, "_lost", {})
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    client = store_client.connect("127.0.0.1", master.port, 10.0)
    client.set("k", "v")
    assert master.get("k") == b"v"
    assert client.raw.timeout == datetime.timedelta(seconds=10)  # its calls' timeout, not a try's


def test_a_store_that_dies_between_the_probe_and_the_handshake_is_lost_within_a_try(monkeypatch):
    """The plain connect found the store; it died before TCPStore's own connect, which
    retried the refused connect for the caller's whole timeout. The next try's probe
    finds it gone."""
    monkeypatch.setattr(store_client, "_lost", {})
    port = _dead_port()
    probes: list[int] = []
    real = store_client.refused

    def first_answers(host, p):  # the first probe still saw it listening
        probes.append(p)
        return None if len(probes) == 1 else real(host, p)

    monkeypatch.setattr(store_client, "refused", first_answers)
    monkeypatch.setattr(store_client, "TRY_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(StoreLostError, match="refused"):
        store_client.connect("127.0.0.1", port, 60.0)
    assert time.monotonic() - t0 < 20 and len(probes) >= 2
