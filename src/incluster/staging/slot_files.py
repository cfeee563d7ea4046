"""A slot's file: sized, mapped, written - the staging side of :class:`~incluster.staging.slots.SlotRing`.

Mixed into ``SlotRing`` (the one owner of every slot's state): these methods change a
slot's file and mapping, never its state. The staging thread calls them for a slot it
holds (``prepare``), a restore for a slot it took (``open_for_writes``, ``write_at``).
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import TYPE_CHECKING, Any, Callable

import torch

from incluster.errors import CheckpointError
from incluster.testing import faults

if TYPE_CHECKING:
    from incluster.staging.slots import Slot


class SlotFiles:
    """File and mapping operations on the slots of a ring (see the module doc)."""

    folder: str
    owner: int
    _on_map: Callable[["Slot"], None] | None
    _on_unmap: Callable[["Slot"], None] | None

    def prepare(self, slot: "Slot", size: int) -> torch.Tensor:
        """Make the slot exactly ``size`` bytes, mapped; returns the uint8 view."""
        if slot.buf is not None and slot.size == size:
            return slot.buf
        self._resize(slot, size, allocate=True)
        if size:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            slot.mm = mmap.mmap(slot.fd, size, flags=flags)
            slot.buf = torch.frombuffer(slot.mm, dtype=torch.uint8)
        else:
            slot.buf = torch.empty(0, dtype=torch.uint8)
        slot.maps += 1
        if self._on_map is not None:
            self._on_map(slot)
        return slot.buf

    def open_for_writes(self, slot: "Slot", size: int) -> int:
        """Make the slot exactly ``size`` bytes for plain ``pwrite`` (a restore writes what
        it received); returns the slot's fd. Not mapped: pages the file already has are
        overwritten in place, missing ones are allocated by the writes themselves (no
        zeroing pass, no page-table population). The next ``prepare`` maps it."""
        self._resize(slot, size, allocate=False)
        return slot.fd

    def _resize(self, slot: "Slot", size: int, *, allocate: bool) -> None:
        """Unmap the slot, open its file (never through a link) and make it ``size``
        bytes; growing it ``fallocate``-s the new pages when ``allocate``."""
        if self._on_unmap is not None and slot.buf is not None:
            self._on_unmap(slot)
        slot.unmap()
        if slot.fd < 0:
            slot.fd = os.open(slot.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        old = os.fstat(slot.fd).st_size
        if old > size:
            os.ftruncate(slot.fd, size)
        elif old < size:
            try:
                faults.check("allocate", self.owner, slot.step)
                if allocate:
                    os.posix_fallocate(slot.fd, 0, size)
            except OSError as exc:
                raise self._no_room(size, exc) from None
        slot.size = size

    def write_at(self, slot: "Slot", offset: int, pieces: list[Any]) -> int:
        """Write ``pieces`` (buffers) into the slot's file from ``offset``; returns the end."""
        for i in range(0, len(pieces), 512):  # IOV_MAX is 1024 on Linux
            batch = [memoryview(p).cast("B") for p in pieces[i : i + 512]]
            while batch:
                try:
                    n = os.pwritev(slot.fd, batch, offset)
                except OSError as exc:
                    raise self._no_room(slot.size, exc) from None
                if n <= 0:
                    raise self._no_room(slot.size, OSError(28, "no progress writing the slot"))
                offset += n
                while batch and n >= batch[0].nbytes:
                    n -= batch[0].nbytes
                    batch.pop(0)
                if batch and n:
                    batch[0] = batch[0][n:]
        return offset

    def _no_room(self, size: int, exc: OSError) -> CheckpointError:
        # Not "lower keep": a ring with room for 2 slots or more shrinks to them by itself
        # (saving._fit_ring); with room for fewer, no keep helps.
        err = CheckpointError(
            f"cannot allocate {size} bytes for a checkpoint slot in {self.folder}: {exc.strerror}; free space "
            f"there (RAM disk full?) or point local_dir elsewhere: saves need room for at least 2 slots of "
            f"{size / 2**20:.1f} MiB (the newest step stays while the next is written)"
        )
        err.no_room = exc.errno == errno.ENOSPC  # type: ignore[attr-defined]
        return err

