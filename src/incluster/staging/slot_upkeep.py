"""The slot ring's upkeep: retention of committed slots past ``keep``, and the ring cut
to the slots the RAM disk has room for (and grown back) - mixed into
:class:`~incluster.staging.slots.SlotRing`, under its lock like every state change."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

from incluster.staging.slot_types import (_SET_ASIDE, _SHARD, _SIDECAR, STAGING_PREFIX, Slot, SlotState, allocated,
                                          sidecar_file)


class SlotUpkeep:
    """Retention and the ring's size (see the module doc)."""

    folder: str
    keep: int
    asked: int
    slots: list[Slot]
    _cond: threading.Condition
    _on_unmap: Callable[[Slot], None] | None

    def _next_index(self) -> int:
        """The lowest slot number no slot has (its staging file's name)."""
        used = {s.index for s in self.slots}
        return next(i for i in range(len(used) + 1) if i not in used)

    def leave_out_unallocated(self) -> int | None:
        """The RAM disk had no room for a new slot: the free slots that never got their
        RAM leave the ring, and ``keep`` becomes the slots that have it, so saves reuse
        those (the oldest step that is not the newest goes) instead of failing on an empty
        one again and again. Returns the new ``keep``; None when nothing was left out or
        fewer than 2 slots would remain (no save could land beside the newest step)."""
        with self._cond:
            empty = [s for s in self.slots if s.state is SlotState.FREE and s.buf is None and not s.uploading
                     and allocated(s.path) == 0]
            left = len(self.slots) - len(empty)
            if not empty or left < 2:
                return None
            for slot in empty:
                self.slots.remove(slot)
                self._let_go(slot)
                try:
                    os.unlink(slot.path)
                except FileNotFoundError:
                    pass
            self.keep = left
            self._cond.notify_all()
            return left

    def grow_back(self, size: int) -> bool:
        """After ``leave_out_unallocated``: one slot of ``size`` bytes more, up to the
        ``keep`` asked for, once the RAM disk has room for it twice over (the other ranks
        on the node may grow at the same moment, and partners' replicas need room too).
        True when ``keep`` grew; the next ``acquire_new`` makes the slot, off the training
        path (a slot that then finds no room is left out again, and no save fails for it)."""
        with self._cond:
            if self.keep >= self.asked:
                return False
            try:
                st = os.statvfs(self.folder)
            except OSError:
                return False
            if st.f_bavail * st.f_frsize < 2 * size:
                return False
            self.keep += 1
            return True

    def drop_unheld(self, newest: int) -> None:
        """Retention once ``newest`` is committed on every rank: the newest ``keep`` steps up
        to it stay, whether a slot holds the step's bytes or - a shared replica - only its
        record (its bytes are the peer's own shard on this node); so do steps a slot is
        still working on. Older records and shards no slot holds go (left by an earlier
        process, or un-adopted), and a committed slot holding an older step gives its RAM
        back: a replica ring that now only gets shared records (data-parallel peers) would
        otherwise keep its old shards, adopted or received, for good."""
        with self._cond:  # a commit in flight renames and marks under this lock too
            names = sorted(os.listdir(self.folder))  # ".json" (the marker) before the shard
            recorded = {int(m.group(1)) for n in names if (m := _SIDECAR.match(n))}
            recorded |= {s.step for s in self.slots if s.state is SlotState.COMMITTED and s.step is not None}
            kept = set(sorted(s for s in recorded if s <= newest)[-self.keep :])
            for s in self.slots:
                if (s.state is SlotState.COMMITTED and s.step is not None and s.step < newest
                        and s.step not in kept and not s.uploading and not s.warming):
                    self._retire(s)
            held = {s.step for s in self.slots if s.step is not None and s.state is not SlotState.FREE}
            for name in names:
                m = _SHARD.match(name) or _SIDECAR.match(name) or _SET_ASIDE.match(name)
                if m and int(m.group(1)) < newest and int(m.group(1)) not in held | kept:
                    try:
                        os.unlink(os.path.join(self.folder, name))
                    except FileNotFoundError:
                        pass
            self._cond.notify_all()

    def _retire(self, slot: Slot) -> None:
        """A committed slot past retention: un-committed (record first), its file and
        mapping gone; the slot stays in the ring, free, made again if it is taken."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.folder, sidecar_file(slot.step)))  # type: ignore[arg-type]
        self._let_go(slot)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.path)
        slot.path = os.path.join(self.folder, f"{STAGING_PREFIX}{slot.index}")
        slot.state, slot.step, slot.size = SlotState.FREE, None, 0

    def _let_go(self, slot: Slot) -> None:
        """Unregister (page-locked memory), unmap and close the slot's file."""
        if self._on_unmap is not None and slot.buf is not None:
            self._on_unmap(slot)
        slot.unmap()
        if slot.fd >= 0:
            os.close(slot.fd)
            slot.fd = -1
