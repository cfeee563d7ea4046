"""Clients of the job store (rank 0's ``TCPStore``), which say a lost store in words.

When rank 0's process ends (SIGKILL, a lost node), every store call of the other ranks
fails with a ``DistNetworkError`` whose text is a C++ backtrace: saves failed as "writer
failed to commit step N: Broken pipe", thousands of lines of frames reached the log, and
each new client (an upload's waits, a writer started again, ``close()``) spent its whole
connect timeout on the dead address - ``close()`` took 36-52 s. Here a network failure is
a :class:`~incluster.errors.StoreLostError` naming the store and what it means. A client
whose connection broke fails its later calls at once (each failed try logs a backtrace),
and for ``LOST_S`` after a broken or refused connection new clients of that address fail
at once too, unless one connects meanwhile. A timeout is never taken for a lost store.
TCPStore retries a refused connect for its whole timeout, then says it "timed out": a
client made after rank 0 died (a writer starting) waits that long. A plain TCP connect
before each client found that at once, but made several multi-rank failure paths ~5 s
slower for a reason not yet found, so it is not done; :func:`refused` asks only when a
writer died of a lost store (``writer_keeping._store_gone``).
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

from incluster.errors import StoreLostError

LOST_STORE = "lost the job store"  # how every such error begins (a writer that died of it is not started again)
LOST_S = 60.0  # how long new clients of a store found gone fail at once
PROBE_S = 2.0  # refused()'s plain connect timeout
_lost: dict[tuple[str, int], tuple[str, float]] = {}
_GONE = ("broken pipe", "connection reset", "got 0 bytes", "connection refused", "connection was likely closed")


def connect(host: str, port: int, timeout_s: float) -> "LostAware":
    """A client of the store at ``host:port`` (``timeout_s``: its connect and call timeout)."""
    from torch.distributed import TCPStore

    known = _lost.get((host, port))
    if known is not None and time.monotonic() - known[1] < LOST_S:
        raise StoreLostError(known[0])
    try:
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)
    except Exception as exc:
        if _network(exc):
            raise StoreLostError(_why(host, port, exc)) from None
        raise
    _lost.pop((host, port), None)  # it answers again
    return LostAware(store, host, port)


def refused(host: str, port: int) -> OSError | None:
    """The error of a plain TCP connect to the store when it was refused (nothing listens:
    rank 0's process is gone - the store exists before any client of incluster's is made);
    None when it connected, or could not tell (no answer: TCPStore's own timeout decides)."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_S):
            return None
    except ConnectionRefusedError as exc:
        return exc
    except OSError:
        return None


def note_lost(host: str, port: int, why: str) -> None:
    """Another process (this rank's writer) found the store at ``host:port`` gone: new
    clients here fail at once too (``close()`` spent 10 s on each)."""
    _lost[(host, port)] = (why, time.monotonic())


class LostAware:
    """A ``TCPStore`` client whose network failures raise :class:`StoreLostError`; once its
    connection broke, every later call fails at once."""

    def __init__(self, store: Any, host: str, port: int) -> None:
        self._store, self._host, self._port = store, host, port
        self._broken: str | None = None

    @property
    def raw(self) -> Any:
        """The ``TCPStore`` itself, for what takes a c10d store (a ``PrefixStore``)."""
        return self._store

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_store", "_host", "_port", "_broken"):
            raise AttributeError(name)  # copy/pickle probe these before __init__ ran: no recursion
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._broken is not None:
                raise StoreLostError(self._broken)
            try:
                return attr(*args, **kwargs)
            except Exception as exc:
                if _network(exc):
                    why = _why(self._host, self._port, exc)
                    if _gone(exc):
                        self._broken = why
                    raise StoreLostError(why) from None
                raise

        return call


def _network(exc: BaseException) -> bool:
    from torch.distributed import DistNetworkError

    return isinstance(exc, (ConnectionError, DistNetworkError))


def _gone(exc: BaseException) -> bool:
    """The connection broke or was refused (the store's process is gone), not a timeout."""
    text = str(exc).lower()
    return "timed out" not in text and "timeout" not in text and any(g in text for g in _GONE)


def _why(host: str, port: int, exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0][:160] if text else type(exc).__name__
    why = (f"{LOST_STORE} (rank 0's, at {host}:{port}: {first}): rank 0's process ended or its node cannot "
           f"be reached, so no step can be durable until the job restarts")
    if _gone(exc):
        _lost[(host, port)] = (why, time.monotonic())
    return why
