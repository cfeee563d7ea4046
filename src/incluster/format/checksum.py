"""Chunked xxh3-64 checksums over every byte of a shard file.

Chunked so a verifier can stream and several threads can share the work: xxhash's C
code releases the GIL, so hashing runs beside the trainer's Python thread.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from incluster.errors import CorruptCheckpointError

ALGO = "xxh3_64"
DEFAULT_CHUNK = 64 * 1024 * 1024
_pool: ThreadPoolExecutor | None = None


def core_share() -> int:
    """This rank's share of the node's cores (ranks per node from torchrun's LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cores // local)


def env_int(name: str, default: int, lo: int = 1, hi: int = 1 << 20) -> int:
    """An integer tuning variable from the environment, ``default`` where unset; a value
    that is not an integer in [lo, hi] is an error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ValueError(f"{name}={raw!r}: expected an integer from {lo} to {hi}; unset it for the default ({default})")
    return value


def hash_threads() -> int:
    """Threads that hash one shard: this rank's share of the node's cores, at least 2 and
    at most 16, so the hashing keeps up with a device-to-host drain (~55 GB/s). On the
    H200 host (16 cores, 4.5 GiB drained) a step was durable in 133 ms with 16, 166 ms
    with 8 and 300 ms with 4 (the writer then fell behind and saves waited), the loop's
    inflation alike with 8 and 16 (docs/measured/gpu-h200-run4.json). The threads work
    only while a save is hashed. ``INCLUSTER_HASH_THREADS`` sets it (the writer process
    reads it when it starts)."""
    return env_int("INCLUSTER_HASH_THREADS", max(2, min(16, core_share())), 1, 256)


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(hash_threads(), thread_name_prefix="incluster-hash")
    return _pool


@dataclass(frozen=True)
class Checksum:
    """Digests of consecutive ``chunk``-byte pieces of a ``size``-byte buffer."""

    size: int
    chunk: int
    digests: tuple[str, ...]
    algo: str = ALGO

    def to_json(self) -> dict[str, Any]:
        return {"algo": self.algo, "size": self.size, "chunk": self.chunk, "digests": list(self.digests)}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "Checksum":
        try:
            algo, size, chunk, digests = obj["algo"], obj["size"], obj["chunk"], obj["digests"]
        except (TypeError, KeyError):
            raise CorruptCheckpointError(f"{where}: checksum record is malformed") from None
        if algo != ALGO:
            raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {algo!r}")
        ok = type(size) is int and type(chunk) is int and size >= 0 and chunk > 0
        if not ok or not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            raise CorruptCheckpointError(f"{where}: checksum record has bad fields")
        if len(digests) != max(1, -(-size // chunk)):
            raise CorruptCheckpointError(f"{where}: checksum record has {len(digests)} digests for {size} bytes")
        return cls(size=size, chunk=chunk, digests=tuple(digests), algo=algo)


def content_id(cs: "Checksum") -> int:
    """A signed 64-bit digest of a whole buffer's checksum record: equal records (same
    size, chunking and chunk digests) give equal ids; callers compare the records too."""
    h = xxhash.xxh3_64()
    h.update(f"{cs.algo}:{cs.size}:{cs.chunk}:".encode())
    for d in cs.digests:
        h.update(d.encode())
    v = h.intdigest()
    return v - (1 << 64) if v >= 1 << 63 else v


def digest(view: Any) -> str:
    """One chunk's digest (xxh3-64, hex); releases the GIL while it hashes."""
    return format(xxhash.xxh3_64_intdigest(view), "016x")


_digest = digest


def checksum_pool() -> ThreadPoolExecutor:
    """The process's hashing threads (``hash_threads()`` of them)."""
    return _executor()


def compute(buf: Any, size: int | None = None, chunk: int = DEFAULT_CHUNK) -> Checksum:
    """Checksum the first ``size`` bytes of a buffer (mmap, bytes, memoryview)."""
    view = memoryview(buf).cast("B")
    n = view.nbytes if size is None else size
    try:
        pieces = [view[i : min(i + chunk, n)] for i in range(0, n, chunk)] or [view[0:0]]
        if len(pieces) == 1:
            digests = [_digest(pieces[0])]
        else:
            digests = list(_executor().map(_digest, pieces))
        for p in pieces:
            p.release()
    finally:
        view.release()
    return Checksum(size=n, chunk=chunk, digests=tuple(digests))


class Frontier:
    """Hash the ``chunk``-byte pieces of a buffer that is still being filled, each on the
    pool as soon as every byte below its end has landed: the hashing overlaps the copies
    in (a device-to-host drain, or copies into a slot) instead of following them."""

    def __init__(self, buf: Any, size: int, chunk: int = DEFAULT_CHUNK) -> None:
        self.view, self.size, self.chunk = memoryview(buf).cast("B"), size, chunk
        self.futures: list[Future[str]] = []

    def advance(self, upto: int) -> None:
        """Every byte below ``upto`` is in: hash each chunk that ends at or below it."""
        pool, chunk = _executor(), self.chunk
        while len(self.futures) * chunk < self.size and min(self.size, (len(self.futures) + 1) * chunk) <= upto:
            k = len(self.futures)
            self.futures.append(pool.submit(_digest, self.view[k * chunk : min(self.size, (k + 1) * chunk)]))
        if self.size == 0 and not self.futures:
            self.futures.append(pool.submit(_digest, self.view[0:0]))

    def digests(self) -> tuple[str, ...]:
        """Every chunk's digest (all bytes are in: hashes what is left, then waits)."""
        self.advance(self.size)
        return tuple(f.result() for f in self.futures)


def _mismatch(where: str, expected: Checksum, i: int) -> CorruptCheckpointError:
    lo = i * expected.chunk
    return CorruptCheckpointError(
        f"{where}: checksum mismatch in bytes {lo}..{min(lo + expected.chunk, expected.size)}; "
        f"this copy is corrupt - a replica or an older step will be used"
    )


class ChunkVerifier:
    """Verify bytes as they arrive, in file order, one checksum chunk at a time.

    ``update`` takes consecutive pieces (any sizes) starting at chunk ``first``'s first
    byte; each chunk is compared the moment its last byte is in, so a reader can check
    what it just copied while it is still in the cache. Raises
    :class:`CorruptCheckpointError` at the first chunk that differs; ``finish`` checks
    that every byte up to ``end`` (default: the whole buffer) came in."""

    def __init__(self, expected: Checksum, where: str, first: int = 0) -> None:
        self.expected, self.where = expected, where
        self.index = first
        self.pos = first * expected.chunk  # absolute offset of the next byte
        self._h = xxhash.xxh3_64()

    def update(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        chunk, size = self.expected.chunk, self.expected.size
        while view.nbytes:
            end = min((self.index + 1) * chunk, size)
            if self.pos + view.nbytes > size:
                raise CorruptCheckpointError(f"{self.where}: more than the {size} bytes the commit record says")
            take = min(view.nbytes, end - self.pos)
            self._h.update(view[:take])
            self.pos += take
            view = view[take:]
            if self.pos == end:
                self._close_chunk()

    def _close_chunk(self) -> None:
        got = format(self._h.intdigest(), "016x")
        if got != self.expected.digests[self.index]:
            raise _mismatch(self.where, self.expected, self.index)
        self.index += 1
        self._h.reset()

    def finish(self, end: int | None = None) -> None:
        end = self.expected.size if end is None else end
        if self.expected.size == 0 and self.index == 0:
            self._close_chunk()  # the one digest of an empty buffer
        if self.pos != end:
            raise CorruptCheckpointError(
                f"{self.where}: {self.pos} bytes checked but {end} expected (truncated or padded)"
            )


def verify(buf: Any, expected: Checksum, where: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``buf`` matches ``expected`` exactly."""
    n = memoryview(buf).nbytes
    if n != expected.size:
        raise CorruptCheckpointError(
            f"{where}: {n} bytes on disk but the commit record says {expected.size} (truncated or padded)"
        )
    got = compute(buf, expected.size, expected.chunk)
    for i, (a, b) in enumerate(zip(got.digests, expected.digests)):
        if a != b:
            raise _mismatch(where, expected, i)
