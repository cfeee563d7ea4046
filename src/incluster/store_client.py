"""Clients of the job store (rank 0's ``TCPStore``), which say a lost store in words.

When rank 0's process ends (SIGKILL, a lost node), every store call of the other ranks
fails with a ``DistNetworkError`` whose text is a C++ backtrace: saves failed as "writer
failed to commit step N: Broken pipe", thousands of lines of frames reached the log, and
each new client (an upload's waits, a writer started again, ``close()``) spent its whole
connect timeout on the dead address - ``close()`` took 36-52 s. Here a network failure is
a :class:`~incluster.errors.StoreLostError` naming the store and what it means, and for
``LOST_S`` after it new clients and calls of that address fail at once, without a try
(each failed try logs its backtrace).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from incluster.errors import StoreLostError

LOST_S = 60.0  # how long new clients of a store found lost fail at once
_lost: dict[tuple[str, int], tuple[str, float]] = {}


def connect(host: str, port: int, timeout_s: float) -> "LostAware":
    """A client of the store at ``host:port`` (``timeout_s``: its connect and call timeout)."""
    from torch.distributed import TCPStore

    _refuse_if_lost(host, port)
    try:
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)
    except Exception as exc:
        if _network(exc):
            raise _lost_error(host, port, exc) from None
        raise
    return LostAware(store, host, port)


class LostAware:
    """A ``TCPStore`` client whose network failures raise :class:`StoreLostError`."""

    def __init__(self, store: Any, host: str, port: int) -> None:
        self._store, self._host, self._port = store, host, port

    @property
    def raw(self) -> Any:
        """The ``TCPStore`` itself, for what takes a c10d store (a ``PrefixStore``)."""
        return self._store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            _refuse_if_lost(self._host, self._port)  # each failing call logged a C++ backtrace
            try:
                return attr(*args, **kwargs)
            except Exception as exc:
                if _network(exc):
                    raise _lost_error(self._host, self._port, exc) from None
                raise

        return call


def note_lost(host: str, port: int, why: str) -> None:
    """Another process (this rank's writer) found the store at ``host:port`` lost: new
    clients here fail at once too (``close()`` spent 10 s on each)."""
    _lost[(host, port)] = (why, time.monotonic())


def _refuse_if_lost(host: str, port: int) -> None:
    known = _lost.get((host, port))
    if known is not None and time.monotonic() - known[1] < LOST_S:
        raise StoreLostError(known[0])


def _network(exc: BaseException) -> bool:
    from torch.distributed import DistNetworkError

    return isinstance(exc, (ConnectionError, DistNetworkError))


def _lost_error(host: str, port: int, exc: BaseException) -> StoreLostError:
    text = str(exc).strip()
    first = text.splitlines()[0][:160] if text else type(exc).__name__
    why = (f"lost the job store (rank 0's, at {host}:{port}: {first}): rank 0's process ended or its node cannot "
           f"be reached, so no step can be durable until the job restarts")
    _lost[(host, port)] = (why, time.monotonic())
    return StoreLostError(why)
