"""Restoring into GPU tensors: read -> hash -> host-to-device, pipelined, bounded memory.

A local restore reads each piece of the shard into a page-locked bounce buffer, hashes
it while it is in the cache, and enqueues a non-blocking host-to-device copy into the live
tensor on the buffer's own stream; the next piece goes to another buffer meanwhile. A
buffer is reused once its copy's event has fired, so host memory stays at most
``count x size`` whatever the state's size, and no pageable copy or second full copy of
the state is ever made. Page-locked memory is slow to allocate (0.4-0.66 s per GiB on
the H200 host, ``pinned_alloc_s`` in ``docs/measured/gpu-h200*.json``): a pool made whole
before the first read put 512 MiB of it on the restore's path (the first restore of a
process took 410 / 747 ms, the next 235 / 290 ms). So buffers are made only when a
reader finds none free (see ``BOUNCE`` for their size); the pool is kept for the
process's later restores (at most 2 per reading thread: 512 MiB with 16).

Used by :func:`incluster.recovery.landing.read_verified` for segments whose target is a
CUDA tensor; CPU-only runs never import CUDA through it. The same pipeline runs with a
CPU "device" in tests, where the copy is a plain memcpy.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

# Bytes per bounce buffer (~0.3 ms of PCIe at 55 GB/s per copy). On the H200 host,
# restores of 4.5 GiB with 16 MiB buffers (a pool made whole first) took 235-290 ms after
# the first; with 4 MiB ones made as needed, 475-637 ms: each buffer costs a handful of
# CUDA calls under the GIL, and 16 readers queue on it. Making one 16 MiB buffer takes
# ~10 ms (0.6 s per GiB page-locked); that is paid once per buffer, by the first restore.
BOUNCE = 16 << 20


class _Buf:
    __slots__ = ("host", "view", "stream", "event")

    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        self.view = memoryview(self.host.numpy())  # type: ignore[arg-type]
        self.stream: Any = torch.cuda.Stream(device=device) if cuda else None
        self.event: Any = None


class Bounce:
    """Up to ``count`` page-locked buffers of ``size`` bytes for copies into ``device``,
    each made the first time a reader finds no buffer free."""

    def __init__(self, device: torch.device, count: int, size: int | None = None) -> None:
        self.device, self.size, self.count = device, size or BOUNCE, max(1, count)
        self.bufs: list[_Buf] = []
        self._free: "queue.SimpleQueue[_Buf]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._made = 0  # buffers made or being made (allocation runs outside the lock)

    def take(self) -> _Buf:
        """A buffer whose previous copy has finished: a free one, else a new one while
        fewer than ``count`` exist, else the next one handed back (waits for it)."""
        try:
            b = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                grow = self._made < self.count
                self._made += grow
            if not grow:
                b = self._free.get()
            else:
                try:
                    b = _Buf(self.size, self.device)
                except BaseException:
                    with self._lock:
                        self._made -= 1
                    raise
                with self._lock:
                    self.bufs.append(b)
        if b.event is not None:
            b.event.synchronize()
            b.event = None
        return b

    def send(self, b: _Buf, n: int, dest: torch.Tensor, after: Any = None) -> None:
        """Copy the first ``n`` bytes of ``b`` into ``dest`` (uint8, ``n`` bytes) without
        waiting; ``b`` goes back to the pool and is handed out again once the copy is done.
        ``after``: an event on the compute stream the copy must follow (see
        :func:`compute_mark`)."""
        try:
            if b.stream is None:
                dest.copy_(b.host[:n])
            else:
                if after is not None:
                    b.stream.wait_event(after)
                # The device first: a bare stream context on a reading thread (current
                # device 0) would set device 0 back on exit, making a context there.
                with torch.cuda.device(b.stream.device), torch.cuda.stream(b.stream):
                    dest.copy_(b.host[:n], non_blocking=True)
                    b.event = torch.cuda.Event()
                    b.event.record(b.stream)
        finally:
            self._free.put(b)

    def give_back(self, b: _Buf) -> None:
        """Return a buffer taken but not sent (its reader failed): never lost to the pool."""
        self._free.put(b)

    def finish(self) -> None:
        """Every copy sent so far has landed."""
        with self._lock:
            bufs = list(self.bufs)
        for b in bufs:
            ev = b.event
            if ev is not None:
                ev.synchronize()


def compute_mark(device: torch.device | None) -> Any:
    """An event at the end of the work enqueued so far on ``device``'s current stream, or
    None (no GPU). The buffers' streams wait for it: the restore writes into the live
    tensors, and work still queued there - the optimizer step that makes a new optimizer's
    state, a ``model.to(device)`` - would otherwise land after the restored bytes and
    overwrite them, unseen (the bytes were checked on the host)."""
    if device is None or device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


_pools: dict[tuple[str, int | None, int], Bounce] = {}
_lock = threading.Lock()


def bounce_for(device: torch.device, workers: int) -> Bounce:
    """The process's pool for ``device``: up to two buffers per reading thread."""
    key = (device.type, device.index, workers)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = Bounce(device, 2 * workers)
        return pool
