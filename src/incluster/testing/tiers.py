"""Tier wrappers for tests: a store that fails, a store that is slow.

Wrap any :class:`~incluster.tiers.base.Tier` and pass the wrapper as ``persistent=``::

    flaky = FaultyTier(FsspecTier("/tmp/ckpt"), ops=("write",), times=2)   # 2 failed writes, then fine
    down = FaultyTier(FsspecTier("/tmp/ckpt"))                             # unreachable for good
    slow = SlowTier(FsspecTier("/tmp/ckpt"), bytes_per_s=50e6, latency_s=0.2)

Both are picklable, so they also reach the writer process (``writer="process"``); each
process then counts its own calls.
"""

from __future__ import annotations

import errno
import time
from typing import Any, Iterable

OPS = ("write", "read", "delete", "list")


class FaultyTier:
    """Fails chosen operations with an ``OSError`` (``ECONNREFUSED`` unless told).

    ``ops``: which of write/read/delete/list fail; ``after``: calls of those that succeed
    first; ``times``: how many then fail (None: all later ones); ``paths``: only paths
    containing one of these substrings count; ``posix=False``: play an object store even
    over a local folder (its errors then speak of credentials, not of a folder's mode).
    """

    def __init__(
        self,
        inner: Any,
        *,
        ops: Iterable[str] = OPS,
        after: int = 0,
        times: int | None = None,
        paths: Iterable[str] = (),
        errno_: int = errno.ECONNREFUSED,
        posix: bool | None = None,
    ) -> None:
        self.ops = tuple(ops)
        bad = [o for o in self.ops if o not in OPS]
        if bad:
            raise ValueError(f"ops must be among {OPS} (got {bad})")
        if after < 0 or (times is not None and times < 0):
            raise ValueError("after and times must be >= 0")
        self.inner, self.after, self.times = inner, after, times
        self._posix = posix  # None: as the tier it wraps; False: play an object store
        self.paths, self.errno = tuple(paths), errno_
        self.calls = 0  # matching calls seen
        self.failures = 0  # of them, failed

    def _gate(self, op: str, path: str) -> None:
        if op not in self.ops or (self.paths and not any(p in path for p in self.paths)):
            return
        self.calls += 1
        if self.calls <= self.after or (self.times is not None and self.failures >= self.times):
            return
        self.failures += 1
        raise OSError(self.errno, f"injected: the store refused {op} of {path!r} (FaultyTier)")

    @property
    def url(self) -> Any:
        return getattr(self.inner, "url", None)

    @property
    def posix(self) -> bool:
        """Whether the tier it wraps is a local folder (its errors name that folder)."""
        return bool(getattr(self.inner, "posix", False)) if self._posix is None else self._posix

    @property
    def process_local(self) -> bool:
        return bool(getattr(self.inner, "process_local", False))

    def write(self, path: str, data: memoryview, *, atomic: bool = True) -> None:
        self._gate("write", path)
        self.inner.write(path, data, atomic=atomic)

    def read(self, path: str, into: memoryview | None = None) -> bytes | int:
        self._gate("read", path)
        return self.inner.read(path, into)  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        self._gate("delete", path)
        self.inner.delete(path)

    def list(self, prefix: str = "") -> list[str]:
        self._gate("list", prefix)
        return self.inner.list(prefix)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"FaultyTier({self.inner!r}, ops={self.ops}, after={self.after}, times={self.times})"


class SlowTier:
    """Adds ``latency_s`` to every call and paces reads and writes to ``bytes_per_s``."""

    def __init__(self, inner: Any, *, bytes_per_s: float | None = None, latency_s: float = 0.0) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0 or None (got {bytes_per_s!r})")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0 (got {latency_s!r})")
        self.inner, self.bytes_per_s, self.latency_s = inner, bytes_per_s, latency_s

    def _wait(self, nbytes: int, started: float) -> None:
        due = self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)
        left = due - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)

    def write(self, path: str, data: memoryview, *, atomic: bool = True) -> None:
        t0 = time.monotonic()
        self.inner.write(path, data, atomic=atomic)
        self._wait(memoryview(data).nbytes, t0)

    def read(self, path: str, into: memoryview | None = None) -> bytes | int:
        t0 = time.monotonic()
        got = self.inner.read(path, into)
        self._wait(got if isinstance(got, int) else len(got), t0)
        return got  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        t0 = time.monotonic()
        self.inner.delete(path)
        self._wait(0, t0)

    def list(self, prefix: str = "") -> list[str]:
        t0 = time.monotonic()
        out = self.inner.list(prefix)
        self._wait(0, t0)
        return out  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()

    @property
    def process_local(self) -> bool:
        return bool(getattr(self.inner, "process_local", False))

    def __repr__(self) -> str:
        return f"SlowTier({self.inner!r}, bytes_per_s={self.bytes_per_s}, latency_s={self.latency_s})"
