"""The trainer's side of a drain run by the writer process (``gpu_drain="writer"``).

Why another process: on the H200, any device-to-host copy the training loop makes
(``loss.item()``, a pinned copy and a stream sync alike) waited for *every* device-to-host
copy its process had in flight, so a 4.5 GiB drain enqueued by the trainer process
stretched the step after each save from 17 ms to 88 ms, whatever the drain's stream
priority or piece size. The same drain enqueued by another process cost the loop 4.5 ms
in all (``bench/gpu_overlap.py``, ``docs/measured/gpu-h200-overlap-variants.json``).

So the device-side snapshot buffer is shared with the writer process once (CUDA IPC),
and each save only tells the writer which file ranges of the buffer to copy into the slot
(the writer has the slot file mapped and page-locked itself); the writer hashes as the
bytes land, says DRAINED, then commits. The buffer is taken again only once the writer
has said it is done with it (``wait_free``), or has died.

Until a writer has opened the buffer (the first save after it was made, or after a writer
restart) the save drains on the trainer's staging thread as before: never a wait.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import threading
import time
from typing import Any, Callable

from incluster.errors import CheckpointError

log = logging.getLogger("incluster")


class RemoteDrain:
    """Which buffer the current writer has open, and whether it is still reading it."""

    def __init__(self, writer: Callable[[], Any], slots: Callable[[], list[tuple[int, str, int, int]]]) -> None:
        self._writer = writer  # the Checkpointer's current writer (a new one after a restart)
        self._slots = slots  # (index, path, size, Slot.maps) of the mapped slot files, for the writer to pin
        self._lock = threading.Lock()
        self._pin_lock = threading.Lock()
        self._free = threading.Event()
        self._free.set()
        self._buf: Any = None  # the buffer last offered (kept alive: the writer maps it)
        self._buf_id = 0
        self._offered: tuple[int, int] | None = None  # (writer gen, buffer id) sent to a writer
        self._open: tuple[int, int] | None = None  # (writer gen, buffer id) a writer has open
        self._said = False
        self._told: tuple[int, set[tuple[int, int]]] = (-1, set())  # writer gen, (slot, maps) it was told to pin
        self.busy_step: int | None = None
        self._drained: dict[int, float] = {}  # step -> perf_counter of its DRAINED, until taken

    def offer(self, buf: Any) -> bool:
        """True if the current writer has ``buf`` open (a drain can go there now); else
        share it with the writer, in the background, and return False."""
        writer = self._writer()
        share = getattr(writer, "share_device_buffer", None)
        if share is None or getattr(writer, "dead", None) is not None:
            return False
        with self._lock:
            if buf is not self._buf:
                self._buf, self._buf_id = buf, self._buf_id + 1
            key = (writer.gen, self._buf_id)
            if self._open == key:
                return True
            if self._offered == key:
                return False
            self._offered = key
        try:
            slots = self._slots()
            self._note_told(writer.gen, slots)
            share(self._buf_id, buf, slots)
        except Exception as exc:  # noqa: BLE001 - the trainer drains instead
            self._refused(f"could not be shared: {exc}")
        _remove_ipc_files_at_exit()
        return False

    def pin_ahead(self) -> None:
        """Off the training path, after slots were made ready: a writer that has the buffer
        open is told of the slot files mapped since (a slot mapped ahead after a restart,
        one grown back), so it page-locks them now, not in the drain that copies into
        them (~0.1 s a GiB, which the save's ``durable`` would pay)."""
        writer = self._writer()
        pin = getattr(writer, "pin_slot_files", None)
        if pin is None or not self.is_open(writer):
            return
        with self._pin_lock:  # one at a time: each slot is told once
            with self._lock:
                told = self._told[1] if self._told[0] == writer.gen else set()
            new = [f for f in self._slots() if (f[0], f[3]) not in told]
            if new:
                self._note_told(writer.gen, new)
                try:
                    pin(new)
                except Exception:  # noqa: BLE001 - a dead writer: its successor is offered every slot
                    pass

    def _note_told(self, gen: int, slots: list[tuple[int, str, int, int]]) -> None:
        with self._lock:
            if self._told[0] != gen:
                self._told = (gen, set())
            self._told[1].update((f[0], f[3]) for f in slots)

    def forget(self) -> None:
        """The buffer is freed (the Checkpointer closed)."""
        with self._lock:
            self._buf, self._open, self._offered = None, None, None

    def is_open(self, writer: Any) -> bool:
        with self._lock:
            return self._open == (getattr(writer, "gen", None), self._buf_id)

    @property
    def buf_id(self) -> int:
        return self._buf_id

    def on_ready(self, gen: int, buf_id: int, error: str | None) -> None:
        """The writer's answer to an offer (its receiving thread)."""
        with self._lock:
            opened = error is None
            if opened:
                self._open = (gen, buf_id)
        if not opened:
            self._refused(error)  # type: ignore[arg-type]
            return
        # Slots mapped since the offer (the one mapped ahead right after it): told now, from
        # a thread of its own (this one reads the writer's answers, which a send may wait for).
        threading.Thread(target=self.pin_ahead, name="incluster-pin-ahead", daemon=True).start()

    def _refused(self, why: str) -> None:
        if not self._said:
            self._said = True
            log.warning("incluster: the writer process cannot drain the device-side snapshot (%s); the "
                        "trainer drains it, so loss.item() right after a save waits for the drain", why)

    def begin(self, step: int) -> None:
        """A drain of ``step`` is handed to the writer: the buffer is in use until it says."""
        with self._lock:
            self.busy_step = step
            self._free.clear()

    def done(self, step: int) -> None:
        """The writer finished reading the buffer for ``step`` (it said DRAINED, or the
        save of ``step`` failed: the writer reports a failed drain only once it stopped
        reading, and a dead writer reads nothing). Another step's news frees nothing."""
        with self._lock:
            if step != self.busy_step:
                return
            self.busy_step = None
            self._drained[step] = time.perf_counter()
            while len(self._drained) > 8:  # steps whose commit never asked (failed saves)
                del self._drained[min(self._drained)]
        self._free.set()

    def drained_at(self, step: int) -> float | None:
        """When the writer said it had read ``step``'s snapshot (once; None if it never said)."""
        with self._lock:
            return self._drained.pop(step, None)

    def wait_free(self, timeout: float) -> None:
        """Before a save copies into the buffer again: the writer's previous drain is over."""
        if not self._free.wait(timeout):
            raise CheckpointError(
                f"the writer process has not finished reading step {self.busy_step}'s device-side snapshot "
                f"after {timeout:.0f} s; is it stopped? (gpu_drain='trainer' keeps the drain in the trainer)"
            )


_cleanup_registered = False


def _remove_ipc_files_at_exit() -> None:
    """The CUDA driver keeps a file per process that shared device memory in /dev/shm
    (``cuda.shm.<uid>.<pid in hex>.<n>``, seen on the H200 machine) and leaves it there
    when the process ends; ours go when this process exits, when nothing can use them."""
    global _cleanup_registered
    if _cleanup_registered:
        return
    _cleanup_registered = True
    pattern = f"/dev/shm/cuda.shm.{os.getuid()}.{os.getpid():x}.*"

    def remove() -> None:
        for path in glob.glob(pattern):
            try:
                os.unlink(path)
            except OSError:
                pass

    atexit.register(remove)
