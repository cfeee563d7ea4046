"""The slot ring: shard files in the node's RAM disk, allocated and mapped once, reused.

A slot is a file plus one shared mapping of it. Saves copy into the mapping; the writer
checksums it and renames it to ``step-N.safetensors``; the next save that takes the slot
un-commits it (sidecar unlinked first), renames it to ``.staging-K`` and copies again
into the same pages. Nothing is allocated per save, and no page is faulted in twice:
a new or resized slot is ``posix_fallocate``-d and mapped with ``MAP_POPULATE``.

A slot is reused only when the step it holds is older than the newest committed step,
so the newest complete checkpoint is never destroyed; if no slot qualifies, ``acquire``
waits (bounded) for the commit in flight.

IMPORTANT: the ring is shared by the trainer thread (acquire), the staging thread
(prepare) and the commit thread (mark_committed/release); every state change happens
under ``self._cond``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from typing import Callable

from incluster.errors import CheckpointError, PeerTimeoutError
from incluster.staging.slot_files import SlotFiles
from incluster.staging.slot_types import _SHARD, STAGING_PREFIX, Slot, SlotState, allocated, sidecar_file, step_file
from incluster.staging.slot_upkeep import SlotUpkeep

log = logging.getLogger("incluster")

class SlotRing(SlotUpkeep, SlotFiles):
    """``keep`` reusable shard files for one rank's shard, in ``folder``."""

    def __init__(
        self,
        folder: str,
        keep: int,
        on_map: Callable[[Slot], None] | None = None,
        on_unmap: Callable[[Slot], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.folder = folder
        self.keep = keep
        self.asked = keep  # keep may shrink for want of room (leave_out_unallocated), and grow back
        tail = os.path.basename(os.path.normpath(folder))
        self.owner = int(tail[5:]) if tail.startswith("rank-") and tail[5:].isdigit() else -1
        self.slots: list[Slot] = []
        self.newest_committed: int | None = None  # newest step committed on this rank
        self.newest_global: int | None = None  # newest step committed on every rank
        self._cond = threading.Condition()
        self._on_map = on_map
        self._on_unmap = on_unmap
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self._adopt()

    # -- start-up -------------------------------------------------------------------
    def _adopt(self) -> None:
        """Take over what a previous process left: committed steps stay loadable. Entries
        with our names that are not regular files (a symbolic link planted to make a save
        write elsewhere) are removed, never followed: the link goes, its target stays."""
        names = set()
        for n in os.listdir(self.folder):
            full = os.path.join(self.folder, n)
            ours = _SHARD.match(n) or n.startswith(STAGING_PREFIX) or n.endswith(".json")
            if ours and not stat.S_ISREG(os.lstat(full).st_mode):
                log.warning("incluster: %s is not a regular file (a link?); it is never followed", full)
                if os.path.islink(full) or not os.path.isdir(full):
                    os.unlink(full)
                continue
            names.add(n)
        shards = {int(m.group(1)): n for n in names if (m := _SHARD.match(n))}
        committed = sorted(step for step in shards if sidecar_file(step) in names)
        # A slot's number names its staging file (it goes back to it when un-committed):
        # a torn .staging-K keeps its K, and no other slot may take a K present here.
        staged = {n: int(n[len(STAGING_PREFIX):]) for n in names
                  if n.startswith(STAGING_PREFIX) and n[len(STAGING_PREFIX):].isdigit()}
        taken = set(staged.values())

        def number() -> int:
            i = next(i for i in range(len(taken) + 1) if i not in taken)
            taken.add(i)
            return i

        for step in committed[-self.keep :]:
            self.slots.append(
                Slot(number(), os.path.join(self.folder, step_file(step)), SlotState.COMMITTED, step)
            )
        if committed:
            # Until load() says which step the job agrees on, trust the local view.
            self.newest_committed = self.newest_global = committed[-1]
        torn_shards = {n for step, n in shards.items() if sidecar_file(step) not in names}
        for n in sorted(names):  # torn saves: staging files and shards without a sidecar
            full = os.path.join(self.folder, n)
            torn = n.startswith(STAGING_PREFIX) or n in torn_shards
            if torn or ".json.tmp-" in n:
                if torn and len(self.slots) < self.keep and os.path.isfile(full):
                    self.slots.append(Slot(staged[n] if n in staged else number(), full, SlotState.FREE))
                else:
                    os.unlink(full)

    # -- trainer thread ---------------------------------------------------------------
    def acquire(self, step: int, timeout: float) -> Slot:
        """Take a slot for ``step``: free, new, or holding a superseded step."""
        deadline = time.monotonic() + timeout
        with self._cond:
            highest = self.newest_step()
            if step <= highest:
                raise CheckpointError(
                    f"step {step} is not newer than step {highest}, already saved or being saved; "
                    f"checkpoint steps must increase (continue from the step load() returned)"
                )
            while True:
                slot = self._pick()
                if slot is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    uploads = sorted(s.step for s in self.slots if s.uploading and s.step is not None)
                    held = (f" ({len(uploads)} slot(s) held by uploads of step(s) {uploads} to the persistent "
                            f"tier: is it slow or unreachable?)") if uploads else ""
                    raise PeerTimeoutError(
                        f"no checkpoint slot became free within {timeout:.0f} s: the previous saves are "
                        f"still committing{held}; save less often, raise keep, or raise slot_timeout_s"
                    )
                self._cond.wait(left)
            self._uncommit(slot)
            slot.state, slot.step = SlotState.STAGING, step
            return slot

    def room_for_restore(self, step: int) -> bool:
        """Whether :meth:`acquire_for_restore` would find a slot for ``step``."""
        with self._cond:
            same = any(s.step == step and s.state is SlotState.COMMITTED and not s.uploading for s in self.slots)
            return same or self._restore_slot(step) is not None

    def _restore_slot(self, step: int) -> Slot | None:
        """A free slot, a new one (not yet in the ring), or the oldest committed slot older
        than ``step``; never one holding a newer step or read by an upload."""
        slot = self._free()
        if slot is None and len(self.slots) < self.keep:
            idx = self._next_index()
            slot = Slot(idx, os.path.join(self.folder, f"{STAGING_PREFIX}{idx}"))
        if slot is None:
            old = [s for s in self.slots if s.state is SlotState.COMMITTED and s.step is not None
                   and s.step < step and not s.uploading]
            slot = min(old, key=lambda s: s.step or 0) if old else None
        return slot

    def acquire_for_restore(self, step: int) -> Slot:
        """A slot for a restore's copy of ``step`` (a heal, a download). The plan chose
        ``step``, so a committed slot of that number (a bad copy, another timeline's) is
        freed first; newer steps stay until the restore has loaded (a restore that then
        fails must not have dropped them). Takes a free slot, a new one, or the oldest
        committed slot older than ``step``, never one holding a newer step;
        CheckpointError when there is none (the restore then skips the node's copy)."""
        with self._cond:
            if any(s.step == step and s.state is SlotState.COMMITTED for s in self.slots):
                self._discard(step)
                self._cond.notify_all()
            if any(s.step == step for s in self.slots):
                raise CheckpointError(f"a slot of {self.folder} is already taking step {step}")
            slot = self._restore_slot(step)
            if slot is not None and slot not in self.slots:
                self.slots.append(slot)
            if slot is None:
                raise CheckpointError(f"every slot of {self.folder} holds a step newer than {step}, or is in use")
            self._uncommit(slot)
            slot.state, slot.step = SlotState.STAGING, step
            return slot

    def acquire_new(self) -> Slot | None:
        """A brand-new FREE slot to pre-allocate, or None when the ring is full.

        It is FREE at once, so a save may take it; its staging then queues behind the
        pre-allocation on the staging thread (which is the only caller of prepare)."""
        with self._cond:
            if len(self.slots) >= self.keep:
                return None
            idx = self._next_index()
            s = Slot(idx, os.path.join(self.folder, f"{STAGING_PREFIX}{idx}"), SlotState.FREE)
            self.slots.append(s)
            self._cond.notify_all()
            return s

    def next_taken(self, size: int) -> Slot | None:
        """The committed slot the next save() takes over (the ring full, none free), its
        file opened (never created) when it is ``size`` bytes and not mapped yet: mapped
        ahead after a restart, its step's bytes untouched until that save."""
        with self._cond:
            if len(self.slots) < self.keep or any(s.state is SlotState.FREE and not s.uploading for s in self.slots):
                return None
            s = self._pick()
            if s is None or s.buf is not None or s.state is not SlotState.COMMITTED:
                return None
            try:
                fd = s.fd if s.fd >= 0 else os.open(s.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                return None
            s.fd = fd
            if os.fstat(fd).st_size != size:
                return None
            s.warming = True  # until warmed(): retention must not close its file or unmap it under the mapping
            return s

    def warmed(self, slot: Slot) -> None:
        """The staging thread is done mapping ``slot`` ahead (see :meth:`next_taken`)."""
        with self._cond:
            slot.warming = False

    def newest_step(self) -> int:
        """The newest step a slot holds (saved, or being saved), -1 when none: save() takes only newer."""
        return max((s.step for s in self.slots if s.step is not None), default=-1)

    def has_room(self) -> bool:
        """Whether :meth:`acquire` would take a slot now, without waiting."""
        with self._cond:
            return self._free() is not None or len(self.slots) < self.keep or self._oldest_superseded() is not None

    def free_slots(self) -> list[Slot]:
        """Slots that hold nothing and are not read by an upload (for ``prepare``-ing ahead:
        a save that takes one meanwhile queues behind that on the staging thread)."""
        with self._cond:
            return [s for s in self.slots if s.state is SlotState.FREE and not s.uploading]

    def mapped_slots(self) -> list[Slot]:
        """Slots mapped in this process, free or holding a step (the one mapped ahead of
        the save that takes it over, after a restart): the writer page-locks its own
        mappings of them before a drain needs them."""
        with self._cond:
            return [s for s in self.slots if s.buf is not None and s.size
                    and s.state in (SlotState.FREE, SlotState.COMMITTED)]

    def room_beside_newer(self, step: int) -> bool:
        """A rollback to ``step`` with every slot holding a newer one: the oldest of them
        that no upload reads is dropped (only it: should the rollback fail, the others
        stay loadable). False when there is none."""
        with self._cond:
            newer = [s.step for s in self.slots if s.state is SlotState.COMMITTED and s.step is not None
                     and s.step > step and not s.uploading]
            if not newer:
                return False
            self._discard(min(newer))
            self._cond.notify_all()
            return True

    def discard(self, step: int) -> None:
        """Un-commit a step found corrupt: its sidecar goes, its slot becomes free."""
        with self._cond:
            self._discard(step)
            self._cond.notify_all()

    def forget_unmarked(self) -> None:
        """Committed slots whose commit marker is gone from disk become free: a restore that
        went back un-committed them there (``recovery.node.abandon_newer``), and a writer's
        replica ring, in memory since before it, must take the new timeline's steps beside
        them (not refuse them as older than what it holds)."""
        with self._cond:
            for s in list(self.slots):
                if (s.state is SlotState.COMMITTED and s.step is not None
                        and not os.path.exists(os.path.join(self.folder, sidecar_file(s.step)))):
                    self._discard(s.step)  # any step: no marker, no step (never loadable, nor kept)
            self._cond.notify_all()

    def _discard(self, step: int) -> None:
        try:
            os.unlink(os.path.join(self.folder, sidecar_file(step)))
        except FileNotFoundError:
            pass
        for s in self.slots:
            if s.step == step and s.state is SlotState.COMMITTED:
                # Back to its staging name (open mappings keep their bytes): a free slot left
                # under the step's name would take the file of the next copy of that step
                # (another slot's), and both would write one file.
                staging = os.path.join(self.folder, f"{STAGING_PREFIX}{s.index}")
                if s.path != staging and os.path.exists(s.path):
                    os.replace(s.path, staging)
                s.path = staging
                s.state, s.step = SlotState.FREE, None
        steps = [s.step for s in self.slots if s.state is SlotState.COMMITTED and s.step is not None]
        self.newest_committed = max(steps) if steps else None
        if self.newest_global is not None and self.newest_global >= step:
            self.newest_global = max((x for x in steps if x < step), default=None)

    def fail(self, slot: Slot, step: int) -> None:
        """A save of ``step`` into ``slot`` failed: un-commit whatever it committed here,
        move its file back to the slot's staging name and free the slot - one transition
        under the lock, so no ``acquire`` can take the slot half way. A slot that no
        longer holds ``step`` is left alone."""
        with self._cond:
            if slot.step != step:
                return
            if slot.state is SlotState.COMMITTED:
                self._discard(step)  # committed here, but not on every rank: never loadable
            else:  # a writer that died (or failed) after writing the record, before saying so
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.folder, sidecar_file(step)))
            staging = os.path.join(self.folder, f"{STAGING_PREFIX}{slot.index}")
            final = os.path.join(self.folder, step_file(step))
            if os.path.exists(final):
                os.replace(final, staging)
            slot.path = staging
            slot.state, slot.step = SlotState.FREE, None
            self._cond.notify_all()

    def reset_to(self, step: int | None) -> None:
        """After a restore of ``step``: newer local steps are not complete anywhere; drop them."""
        for s in list(self.slots):
            if s.state is SlotState.COMMITTED and s.step is not None and (step is None or s.step > step):
                self.discard(s.step)
        with self._cond:
            self.newest_global = step
            self._cond.notify_all()

    def set_uploading(self, slot: Slot, on: bool) -> None:
        with self._cond:
            slot.uploading = on
            self._cond.notify_all()

    def _pick(self) -> Slot | None:
        """A free slot, else a new one (the ring not full yet), else the oldest one whose
        step a newer committed everywhere supersedes; None (nothing to take now)."""
        s = self._free()
        if s is not None:
            return s
        if len(self.slots) < self.keep:
            idx = self._next_index()
            s = Slot(idx, os.path.join(self.folder, f"{STAGING_PREFIX}{idx}"))
            self.slots.append(s)
            return s
        return self._oldest_superseded()

    def _free(self) -> Slot | None:
        return next((s for s in self.slots if s.state is SlotState.FREE and not s.uploading), None)

    def _oldest_superseded(self) -> Slot | None:
        old = [s for s in self.slots if s.state is SlotState.COMMITTED and s.step is not None
               and s.step < (self.newest_global or -1) and not s.uploading]
        return min(old, key=lambda s: s.step or 0) if old else None

    def _uncommit(self, slot: Slot) -> None:
        staging = os.path.join(self.folder, f"{STAGING_PREFIX}{slot.index}")
        if slot.state is SlotState.COMMITTED and slot.step is not None:
            try:  # the sidecar goes first: from here on the old step does not exist
                os.unlink(os.path.join(self.folder, sidecar_file(slot.step)))
            except FileNotFoundError:
                pass
        if slot.path != staging and os.path.exists(slot.path):
            os.replace(slot.path, staging)
        slot.path = staging

    # -- commit thread ----------------------------------------------------------------
    def set_state(self, slot: Slot, state: SlotState) -> None:
        with self._cond:
            slot.state = state
            self._cond.notify_all()

    def mark_committed(self, slot: Slot, step: int, path: str) -> None:
        """The writer (another thread or process) renamed the slot and wrote its marker."""
        with self._cond:
            self._committed(slot, step, path)

    def _committed(self, slot: Slot, step: int, path: str) -> None:
        slot.state, slot.step, slot.path = SlotState.COMMITTED, step, path
        if self.newest_committed is None or step > self.newest_committed:
            self.newest_committed = step
        self._cond.notify_all()

    def commit(self, slot: Slot, step: int, write_marker: Callable[[], None]) -> str:
        """Commit a slot filled in this process (a replica, a restore's heal, a download):
        rename it to the step's name, write its marker, mark it committed - one transition
        under the lock, so no ``drop_unheld``, ``discard`` or ``fail`` sees it half way. A
        marker that cannot be written leaves the slot staged under its staging name."""
        final = os.path.join(self.folder, step_file(step))
        with self._cond:
            if slot.step != step or slot.state not in (SlotState.STAGING, SlotState.COMMITTING):
                raise CheckpointError(f"slot {slot.index} of {self.folder} no longer holds step {step}; please report this")
            os.replace(slot.path, final)
            try:
                write_marker()
            except BaseException:
                os.replace(final, slot.path)
                raise
            self._committed(slot, step, final)
        return final

    def set_global(self, step: int) -> None:
        """``step`` is committed on every rank: older slots may now be reused."""
        with self._cond:
            if self.newest_global is None or step > self.newest_global:
                self.newest_global = step
            self._cond.notify_all()

    def release(self, slot: Slot) -> None:
        """A save failed: the slot holds nothing of value now."""
        with self._cond:
            slot.state, slot.step = SlotState.FREE, None
            self._cond.notify_all()

    def committed_steps(self) -> list[int]:
        with self._cond:
            return sorted(s.step for s in self.slots if s.state is SlotState.COMMITTED and s.step is not None)

    def close(self) -> None:
        with self._cond:
            for s in self.slots:
                self._let_go(s)
