"""The writer process's side of ``gpu_drain="writer"``: copy the trainer's device-side
snapshot into the slot file, hashing as the bytes land (see
:mod:`incluster.staging.remote_drain` for why another process).

The trainer shares its snapshot buffer once (CUDA IPC, torch's own reduction of a CUDA
tensor); this process opens it, and maps and page-locks the slot files itself, so every
copy is an asynchronous DMA into memory the trainer reads back through its own mapping
of the same file. Only imported when a trainer offers a buffer: a CPU job never starts
CUDA in the writer.
"""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import Future
from typing import Any

import torch

from incluster.errors import CheckpointError
from incluster.staging.cuda import host_register, host_unregister
from incluster.staging.device_snapshot import copy_out
from incluster.writer.local_commit import CommitRequest


class DeviceDrains:
    """The opened buffer, the side stream, and the page-locked slot mappings."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.buf: torch.Tensor | None = None
        self.buf_id: int | None = None
        self.device = 0
        self.stream: Any = None
        # id(mapping) -> its uint8 view and the GPU whose context page-locked it (None: not locked)
        self._pinned: dict[int, tuple[torch.Tensor, int | None]] = {}
        self._lock = threading.Lock()  # pin (drains, main loop) and unpin (commits, their thread)
        service.on_unmap = self.unpin

    def open(self, buf_id: int, args: tuple[Any, ...], device: int,
             slots: list[tuple[int, str, int, int]]) -> str | None:
        """Open the shared buffer and page-lock the listed slot files; None, or why not."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        try:
            torch.cuda.set_device(device)
            self.buf, self.buf_id = None, None  # let go of the old buffer first
            self.buf = rebuild_cuda_tensor(*args)
            if self.stream is not None and self.stream.device != torch.device("cuda", device):
                self.stream.synchronize()  # a buffer on another GPU: copies from it need a stream there
                self.stream = None
            self.buf_id, self.device = buf_id, device
            if self.stream is None:
                self.stream = torch.cuda.Stream(device=device)
        except Exception as exc:  # noqa: BLE001 - reported; the trainer drains itself then
            return f"{type(exc).__name__}: {exc}"
        self.pin_files(slots)
        return None

    def pin_files(self, slots: list[tuple[int, str, int, int]]) -> None:
        """Map and page-lock slot files ahead of the drains into them (a drain pins what is missing)."""
        for index, path, size, gen in slots:
            try:
                self.pin(self.service.map_slot(str(index), path, size, populate=False, gen=gen), ahead=True)
            except (OSError, ValueError):
                pass  # the slot was renamed or resized by the trainer meanwhile: pinned when drained into

    def start(self, req: CommitRequest, copied: Any = None) -> list[Future[str]]:
        """Copy the request's runs of the buffer into its slot; returns once the buffer is
        read (after ``copied()``: the trainer may then write its next snapshot), with the
        futures of the whole file's digests, the last chunks still being hashed: the commit
        waits for them on another thread while the next drain already runs here."""
        buf_id, lo, runs = req.drain  # type: ignore[misc]
        if self.buf is None or buf_id != self.buf_id:
            raise CheckpointError(f"step {req.step}: the device-side snapshot {buf_id} is not open in the writer")
        slot = self.pin(self.service.map_slot(str(req.slot), req.staging_path, req.size, populate=False, gen=req.maps))
        try:
            with torch.cuda.device(self.device):
                return copy_out(self.device, lo, runs, self.buf, slot, self.stream, req.chunk, copied)
        finally:
            self.stream.synchronize()  # nothing reads the buffer once we answer

    def pin(self, mm: mmap.mmap, ahead: bool = False) -> torch.Tensor:
        """``mm`` page-locked (once per mapping). ``ahead``: before any drain into it, when
        the trainer may be resizing the file: a refusal is not kept (nor taken as the file
        system's), the drain into it tries again."""
        with self._lock:
            had = self._pinned.get(id(mm))
            if had is not None:
                return had[0]
            t = torch.frombuffer(mm, dtype=torch.uint8)
            # In the buffer's GPU's context (the commit thread's current device is 0). Memory
            # that cannot be page-locked is drained into as it is (said once): slower copies.
            locked = bool(t.numel()) and host_register(t.data_ptr(), t.numel(), self.device, remember=not ahead) is None
            if ahead and not locked:
                return t
            self._pinned[id(mm)] = (t, self.device if locked else None)
            return t

    def close(self) -> None:
        """Let go of the shared buffer (the trainer's process then frees it without a
        warning at exit) and of every page-locked mapping."""
        if self.stream is not None:
            self.stream.synchronize()
        self.buf, self.buf_id = None, None
        with self._lock:
            pinned, self._pinned = list(self._pinned.values()), {}
        for t, dev in pinned:
            _unregister(t, dev)
        torch.cuda.ipc_collect()

    def unpin(self, mm: mmap.mmap) -> None:
        """Before the service closes a mapping."""
        with self._lock:
            had = self._pinned.pop(id(mm), None)
        if had is not None:
            _unregister(*had)


def _unregister(t: torch.Tensor, device: int | None) -> None:
    """In the context that page-locked it (None: it was not page-locked)."""
    if device is not None:
        host_unregister(t.data_ptr(), device)
