"""The CUDA half of staging: pinned slot mappings, side-stream copies, event ordering.

Flow for a save of GPU tensors (DESIGN §5 "Overlap with the forward pass"):
1. ``save()`` records ``start`` on the compute stream (no host block) and returns;
2. the staging thread makes a side stream wait on ``start``, enqueues the device->host
   copies into the slot mapping (registered as pinned memory, so they are true async
   DMA), and records ``done`` on the side stream;
3. the optimizer pre-step hook makes the compute stream wait on ``done``: the GPU
   orders the parameter update after the copies, the host never blocks.

Streams are per device and the trainer's current device need not be the state's (a
script that moves its model to ``cuda:1`` without ``torch.cuda.set_device``, or a model
spread over several GPUs): ``start`` is recorded and ``done`` waited on for each GPU the
state is on, on that GPU's current stream, never on the current device's alone.

Only imported when CUDA is available; CPU-only runs never touch this module.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence, TypeVar

import torch

from incluster.staging.slots import Slot

log = logging.getLogger("incluster")
T = TypeVar("T")


HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_pinner: ThreadPoolExecutor | None = None
_pinner_lock = threading.Lock()
_refused: str | None = None  # why page-locking failed in this process (it is not tried again)


def _on_pinner(fn: Callable[[], T]) -> T:
    """Run a registration call on a thread of its own. A failed CUDA runtime call leaves
    its error as the thread's "last error", which torch reads after its next kernel launch
    on that thread: a refused cudaHostRegister on the staging thread (or an unregister in
    the user's close()) would surface as an unrelated CUDA error in a later copy. That
    thread launches no kernels."""
    global _pinner
    with _pinner_lock:
        if _pinner is None:
            _pinner = ThreadPoolExecutor(1, thread_name_prefix="incluster-pin")
    try:
        fut = _pinner.submit(fn)
    except RuntimeError:  # the interpreter is exiting (close() from an exit hook): no kernel runs after
        return fn()
    return fut.result()


def _status(err: object) -> tuple[int, str]:
    """A cudart call's result: (code, its text; "" for success)."""
    code = int(getattr(err, "value", err))  # type: ignore[call-overload]
    if code == 0:
        return 0, ""
    try:
        return code, f"CUDA error {code}: {torch.cuda.cudart().cudaGetErrorString(err)}"
    except Exception:  # noqa: BLE001 - the code says enough
        return code, f"CUDA error {code}"


def host_register(ptr: int, size: int, device: int, remember: bool = True) -> str | None:
    """Page-lock ``size`` bytes at ``ptr`` in ``device``'s context (Portable: for every
    GPU's context, so copies from each GPU of a state spread over several stay
    asynchronous). None, or why not; after one refusal in this process nothing more is
    tried (the cause - the folder's file system, a limit - holds for every slot).
    ``remember=False``: a refusal is returned only (ahead of time, a file another process
    may be resizing meanwhile: its drain tries again)."""
    if _refused is not None:
        return _refused

    def call() -> tuple[int, str]:
        with torch.cuda.device(device):
            return _status(torch.cuda.cudart().cudaHostRegister(ptr, size, HOST_REGISTER_PORTABLE))

    code, what = _on_pinner(call)
    if code == 0:
        return None
    why = f"cudaHostRegister of {size} bytes failed with {what}"
    return _refuse(why) if remember else why


def _refuse(why: str) -> str:
    global _refused
    if _refused is None:
        _refused = why
        log.warning(
            "incluster: could not page-lock checkpoint memory (%s); saves copy from the GPU through "
            "pageable memory from now on, so each device-to-host copy is synchronous and slower. A RAM disk "
            "(tmpfs, e.g. /dev/shm) as local_dir and a locked-memory limit above the state's size "
            "(ulimit -l) let it page-lock", why)
    return _refused


def host_unregister(ptr: int, device: int) -> None:
    def call() -> tuple[int, str]:
        with torch.cuda.device(device):
            return _status(torch.cuda.cudart().cudaHostUnregister(ptr))

    code, what = _on_pinner(call)
    if code:
        log.warning("incluster: cudaHostUnregister of checkpoint memory failed with %s", what)


def register(slot: Slot, device: int | None = None) -> None:
    """Page-lock the slot mapping so device->host copies into it run asynchronously.
    ``device``: the GPU the saves copy from. A thread's current device is its own (0 on a
    new thread): registering on the staging thread without it would make a CUDA context
    on GPU 0 for every rank of a multi-GPU node, and lock the pages in that context.
    Memory that cannot be page-locked is used as it is (said once): slower, never wrong."""
    if slot.pinned or slot.buf is None or slot.size == 0:
        return
    dev = device if device is not None else torch.cuda.current_device()
    if host_register(slot.buf.data_ptr(), slot.size, dev) is None:
        slot.pinned = True
        slot.pinned_on = dev


def unregister(slot: Slot) -> None:
    """In the context that registered it, whichever thread unmaps the slot."""
    if slot.pinned and slot.buf is not None:
        host_unregister(slot.buf.data_ptr(), slot.pinned_on if slot.pinned_on is not None else torch.cuda.current_device())
    slot.pinned = False
    slot.pinned_on = None


CAN_TELL = hasattr(torch._C, "_cuda_hasPrimaryContext")  # which GPUs this process uses


def active_devices() -> list[int] | None:
    """The GPUs this process has a CUDA context on (every GPU its tensors can be on);
    None where torch cannot tell."""
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is None:
        return None
    return [d for d in range(torch.cuda.device_count()) if has(d)]


def record_start(known: Iterable[int] | None = None) -> dict[int, torch.cuda.Event]:
    """On the trainer thread, in save(): mark where the compute streams are now, on every
    GPU this process has a context on - a superset of the state's, even one it moved to
    since the last save (an event per GPU: microseconds). Recording on a GPU without a
    context would make one there, so only those are marked. Where torch cannot tell
    which have one: ``known`` (the GPUs of the last save's or ``prepare``'s state), else
    the current device."""
    events: dict[int, torch.cuda.Event] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = active_devices()
        if devices is None:
            devices = list(known) if known else [torch.cuda.current_device()]
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events[dev] = ev
    return events


class CudaCopier:
    """One side stream per device; enqueues copies after the save's start event."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def streams(self) -> list[torch.cuda.Stream]:
        return list(self._streams.values())

    def stream(self, dev: int) -> torch.cuda.Stream:
        s = self._streams.get(dev)
        if s is None:
            # The highest priority (out-of-range values map to it): the copy kernels get SMs
            # as soon as a training kernel's blocks retire.
            s = self._streams[dev] = torch.cuda.Stream(device=dev, priority=-100)
        return s

    def enqueue(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        start: dict[int, torch.cuda.Event],
        marks: list[tuple[int, torch.cuda.Event]] | None = None,
        mark_every: int = 64 << 20,
    ) -> list[tuple[int, torch.cuda.Event]]:
        """Enqueue ``dst.copy_(src)`` for GPU sources; returns (device, done event) per device.
        ``marks`` (a state on one GPU): filled with (i, event) after every ``mark_every``
        bytes, the event recorded once ``pairs[i]`` and every pair before it are copied, so
        the host can hash what has landed while the rest is still on its way."""
        by_dev: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in pairs:
            by_dev.setdefault(src.get_device(), []).append((dst, src))
        done: list[tuple[int, torch.cuda.Event]] = []
        for dev, items in by_dev.items():
            stream = self.stream(dev)
            ev = start.get(dev)
            if ev is not None:
                stream.wait_event(ev)
            else:  # a device save() did not mark: order after all its work so far
                stream.wait_stream(torch.cuda.current_stream(dev))
            # The device first: a stream context alone, on a thread whose current device is
            # another, sets that device back on exit - a context made on GPU 0 (CUDA 12).
            one = marks is not None and len(by_dev) == 1
            since = 0
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                for i, (dst, src) in enumerate(items):
                    dst.copy_(src, non_blocking=True)
                    since += dst.nbytes
                    if one and since >= mark_every and i + 1 < len(items):
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        marks.append((i, ev))  # type: ignore[union-attr]
                        since = 0
                end = torch.cuda.Event()
                end.record(stream)
            if one:
                marks.append((len(items) - 1, end))  # type: ignore[union-attr]
            done.append((dev, end))
        return done


def wait_on_compute(done: Sequence[tuple[int, torch.cuda.Event]]) -> None:
    """Pre-step hook body: each GPU's compute stream (the trainer's current stream there,
    where the optimizer's kernels for its tensors run) waits for that GPU's copies; the
    host does not."""
    for dev, ev in done:
        torch.cuda.current_stream(dev).wait_event(ev)
