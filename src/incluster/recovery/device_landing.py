"""Restoring into GPU tensors: read -> hash -> host-to-device, pipelined, bounded memory.

A local restore reads each piece of the shard into a page-locked bounce buffer, hashes
it while it is in the cache, and enqueues a non-blocking host-to-device copy into the live
tensor on the buffer's own stream; the next piece goes to another buffer meanwhile. A
buffer is reused once its copy's event has fired, so host memory stays at
``count x size`` (allocated once per process and device) whatever the state's size, and
no pageable copy or second full copy of the state is ever made.

Used by :func:`incluster.recovery.landing.read_verified` for segments whose target is a
CUDA tensor; CPU-only runs never import CUDA through it. The same pipeline runs with a
CPU "device" in tests, where the copy is a plain memcpy.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

BOUNCE = 16 << 20  # bytes per bounce buffer: large enough to run the link at full speed


class _Buf:
    __slots__ = ("host", "view", "stream", "event")

    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        self.view = memoryview(self.host.numpy())  # type: ignore[arg-type]
        self.stream: Any = torch.cuda.Stream(device=device) if cuda else None
        self.event: Any = None


class Bounce:
    """``count`` page-locked buffers of ``size`` bytes for copies into ``device``."""

    def __init__(self, device: torch.device, count: int, size: int | None = None) -> None:
        self.device, self.size = device, size or BOUNCE
        self.bufs = [_Buf(self.size, device) for _ in range(count)]
        self._free: "queue.SimpleQueue[_Buf]" = queue.SimpleQueue()
        for b in self.bufs:
            self._free.put(b)

    def take(self) -> _Buf:
        """A buffer whose previous copy has finished (waits for one if all are busy)."""
        b = self._free.get()
        if b.event is not None:
            b.event.synchronize()
            b.event = None
        return b

    def send(self, b: _Buf, n: int, dest: torch.Tensor) -> None:
        """Copy the first ``n`` bytes of ``b`` into ``dest`` (uint8, ``n`` bytes) without
        waiting; ``b`` goes back to the pool and is handed out again once the copy is done."""
        if b.stream is None:
            dest.copy_(b.host[:n])
        else:
            with torch.cuda.stream(b.stream):
                dest.copy_(b.host[:n], non_blocking=True)
                b.event = torch.cuda.Event()
                b.event.record(b.stream)
        self._free.put(b)

    def finish(self) -> None:
        """Every copy sent so far has landed."""
        for b in self.bufs:
            ev = b.event
            if ev is not None:
                ev.synchronize()


_pools: dict[tuple[str, int | None, int], Bounce] = {}
_lock = threading.Lock()


def bounce_for(device: torch.device, workers: int) -> Bounce:
    """The process's pool for ``device``: two buffers per reading thread, made once."""
    key = (device.type, device.index, workers)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = Bounce(device, 2 * workers)
        return pool
