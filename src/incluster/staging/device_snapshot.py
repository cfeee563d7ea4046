"""The device-side snapshot: a save's GPU tensors copied device-to-device into a reused
GPU buffer, then drained to the pinned slot in a few large device-to-host copies.

Why: a device-to-host copy of a multi-GiB state takes ~100 ms over PCIe, and the
optimizer step must not change the state until it is done - longer than a forward and
backward of a small step. A device-to-device copy of the same bytes takes ~1 ms per GiB,
so the optimizer waits for that only; the drain overlaps the following steps.

The buffer mirrors the slot file from the first to the last GPU tensor (the same
offsets), so the drain copies whole *runs*: a run is a stretch of the file with no large
CPU tensor in it. Small CPU tensors (AdamW's step counters) are cloned when the save
starts and put in place (inside a run: into the buffer) before the drain. The drain
moves 16 MiB at a time with two copies in flight, and each checksum chunk of the file is
hashed as soon as the drain has passed it, so the shard's digests are ready a few
milliseconds after its last byte lands; the writer then only renames and records.

Memory: ``gpu_snapshot=None`` (automatic) takes the buffer only out of memory this job
has never reserved so far (device total minus the caching allocator's peak, and no more
than the driver reports free), keeping max(2 GiB, 10%) of the device spare; ``0`` never
takes it; a number of bytes takes at most that much. Without room the save copies
device-to-host directly (the optimizer then waits for PCIe) and says so once.

Only imported when a save holds CUDA tensors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from incluster.format.checksum import Frontier, env_int
from incluster.format.dtypes import NAME_TO_DTYPE
from incluster.format.layout import Layout

log = logging.getLogger("incluster")
SMALL_CPU = 1 << 20  # CPU tensors up to this size are cloned at the start of staging
# Bytes per device-to-host copy of the drain (~0.3 ms over PCIe 5), and such copies in
# flight at once; read when the process starts (the writer's, for gpu_drain="writer").
PIECE = env_int("INCLUSTER_DRAIN_PIECE_MIB", 16, 1, 4096) << 20
WINDOW = env_int("INCLUSTER_DRAIN_WINDOW", 2, 1, 64)
GiB = 2**30
RETRY_S = 600.0  # a buffer the GPU had no room for is tried again this long after (memory may free up)


@dataclass
class Plan:
    """How one layout's GPU tensors sit in the device buffer."""

    device: int
    lo: int  # file offset of the buffer's first byte
    runs: list[tuple[int, int]]  # file ranges moved by one device-to-host copy each
    gpu: list[int]  # entry indices of the GPU tensors
    views: list[torch.Tensor]  # typed views into the buffer, one per ``gpu`` entry
    inside: dict[int, torch.Tensor]  # small CPU tensors inside a run: their place in the buffer
    filled: Any = None  # the buffer's zero-fill, on the stream that allocated it: copies wait for it


def make_runs(layout: Layout, kinds: Sequence[str]) -> tuple[int, int, list[tuple[int, int]]]:
    """(lo, hi, runs) over entries of kind "g" (GPU); kind "c" (a large CPU tensor)
    breaks a run, kind "s" (a small CPU tensor, put into the buffer before the drain)
    does not."""
    order = sorted(range(len(kinds)), key=lambda i: layout.entries[i].offset)
    runs: list[tuple[int, int]] = []
    start = end = None
    for i in order:
        e = layout.entries[i]
        if kinds[i] == "c" or not e.nbytes:
            if start is not None and kinds[i] == "c":
                runs.append((start, end))  # type: ignore[arg-type]
                start = end = None
            continue
        if kinds[i] == "g":
            start = e.offset if start is None else start
            end = e.offset + e.nbytes
        elif start is not None:  # a small CPU tensor between GPU ones: carried along
            end = e.offset + e.nbytes
    if start is not None:
        runs.append((start, end))  # type: ignore[arg-type]
    if not runs:
        return 0, 0, []
    return runs[0][0], runs[-1][1], runs


def buffer_views(layout: Layout, kinds: Sequence[str], lo: int, runs: Sequence[tuple[int, int]], buf: torch.Tensor
                 ) -> tuple[list[int], list[torch.Tensor], dict[int, torch.Tensor]]:
    """(gpu, views, inside) of a :class:`Plan` over ``buf`` (which starts at file offset
    ``lo``): the GPU entries that hold bytes with their typed views, and the small CPU
    tensors inside a run with theirs. An empty tensor copies nothing and has no place in
    the buffer (its offset may lie below ``lo``: a view there would start elsewhere)."""
    def at(e: Any) -> torch.Tensor:
        return buf[e.offset - lo : e.offset - lo + e.nbytes].view(NAME_TO_DTYPE[e.spec.dtype]).view(e.spec.shape)

    gpu = [i for i, k in enumerate(kinds) if k == "g" and layout.entries[i].nbytes]
    views = [at(layout.entries[i]) for i in gpu]
    inside = {}
    for i, k in enumerate(kinds):
        e = layout.entries[i]
        if k == "s" and e.nbytes and any(a <= e.offset and e.offset + e.nbytes <= b for a, b in runs):
            inside[i] = at(e)
    return gpu, views, inside


class DeviceSnapshots:
    """The reused buffer (one device) and the per-layout plans over it."""

    def __init__(self, setting: int | None) -> None:
        self.setting = setting
        self.buf: torch.Tensor | None = None
        self.filled: Any = None  # event: the buffer's zero-fill is done
        self.active = False
        self._plans: dict[str, Plan] = {}
        self._said: set[str] = set()
        self._failed: dict[int, tuple[int, float]] = {}  # device -> (smallest buffer it failed for, when)

    def plan(self, layout: Layout, tensors: Sequence[torch.Tensor], kinds: Sequence[str]) -> Plan | None:
        """The plan for this save, with the buffer allocated; None: copy directly."""
        self.active = False
        devices = {tensors[i].get_device() for i, k in enumerate(kinds) if k == "g"}
        if len(devices) != 1:
            self._say("multi", "incluster: the saved state spans several GPUs; copying device-to-host directly")
            return None
        dev = devices.pop()
        # Which tensors are on the GPU is part of the plan: a tensor of the same name, dtype
        # and shape moved from the CPU to the GPU (an EMA copy, say) has no place in a plan
        # made without it, and its bytes in the slot would be a reused slot's old ones.
        key = f"{layout.fingerprint}:{dev}:{''.join(kinds)}"
        plan = self._plans.get(key)
        if plan is not None and self.buf is not None and self.buf.get_device() == dev:
            self.active = True
            return plan
        lo, hi, runs = make_runs(layout, kinds)
        if not runs:  # only empty GPU tensors: nothing to snapshot
            return None
        if not self._room(dev, hi - lo):
            return None
        gpu, views, inside = buffer_views(layout, kinds, lo, runs, self.buf)  # type: ignore[arg-type]
        plan = self._plans[key] = Plan(dev, lo, runs, gpu, views, inside, self.filled)
        self.active = True
        return plan

    def free(self) -> None:
        """Give the buffer's device memory back (the Checkpointer closed)."""
        self.buf, self._plans, self.active, self.filled = None, {}, False, None

    def _room(self, dev: int, need: int) -> bool:
        """Make the buffer at least ``need`` bytes on ``dev`` if the budget allows."""
        if self.buf is not None and self.buf.get_device() == dev and self.buf.numel() >= need:
            return True
        failed, when = self._failed.get(dev, (need + 1, 0.0))
        if self.setting == 0 or (need >= failed and time.monotonic() - when < RETRY_S):
            return False  # off, or no more room than at the last try: not again soon (each try empties the cache)
        free, total = torch.cuda.mem_get_info(dev)
        have = self.buf.numel() if self.buf is not None and self.buf.get_device() == dev else 0
        if self.setting is None:
            spare = max(2 * GiB, total // 10)
            room = min(free, total - torch.cuda.max_memory_reserved(dev)) + have - spare
            why = (f"{need / GiB:.2f} GiB needed, {max(room, 0) / GiB:.2f} GiB of cuda:{dev} left that this job "
                   f"never used (set gpu_snapshot=<bytes> to allow more)")
        else:  # a cap: never past what the driver reports free (a try that fails stalls the device)
            room = min(self.setting, free + have)
            why = f"{need / GiB:.2f} GiB needed, gpu_snapshot={self.setting} bytes allowed" + (
                "" if room == self.setting else f", {(free + have) / GiB:.2f} GiB of cuda:{dev} free")
        if need > room:
            self._say(f"room{need}", f"incluster: no device-side snapshot ({why}); copying device-to-host "
                      f"directly, so the optimizer step waits for PCIe after each save")
            return False
        self.buf, self._plans = None, {}
        try:
            with torch.cuda.device(dev), _not_expandable():
                self.buf = torch.zeros(need, dtype=torch.uint8, device=dev)
                # The fill runs on this thread's current stream, behind any training work
                # queued there; the snapshot's stream is not ordered after it by itself.
                self.filled = torch.cuda.Event()
                self.filled.record(torch.cuda.current_stream(dev))
        except torch.cuda.OutOfMemoryError:
            # Each failed try has the caching allocator free every cached block and try again
            # (a device-wide stall): a buffer this large is not tried again for RETRY_S.
            self._failed[dev] = (min(need, self._failed.get(dev, (need, 0.0))[0]), time.monotonic())
            self._say(f"oom{need}", f"incluster: could not allocate the {need / GiB:.2f} GiB device-side "
                      f"snapshot on cuda:{dev}; copying device-to-host directly (tried again in {RETRY_S / 60:.0f} min)")
            return False
        log.info("incluster: device-side snapshot buffer of %.2f GiB on cuda:%d (gpu_snapshot=%s)",
                 need / GiB, dev, "auto" if self.setting is None else self.setting)
        return True

    def _say(self, key: str, msg: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", msg)


@contextlib.contextmanager
def _not_expandable() -> Iterator[None]:
    """The buffer outside expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``):
    such memory is shared by passing file descriptors that the writer takes with
    ``pidfd_getfd``, which a child may not do to its parent under Yama's default
    ``ptrace_scope=1`` and most container profiles, so the writer could never drain. The
    caching allocator honours the setting switched off for this one allocation (it then
    picks no block of an expandable segment) and on again after it."""
    conf = ",".join(v for v in (os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")) if v)
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.13; before it:
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    off = re.sub(r"expandable_segments\s*:\s*true", "expandable_segments:False", conf, flags=re.IGNORECASE)
    if off == conf or setter is None:
        yield
        return
    # The whole setting each time: a string of one key resets the others (max_split_size_mb,
    # garbage_collection_threshold, ...) to their defaults for the rest of the run.
    setter(off)
    try:
        yield
    finally:
        setter(conf)


def warm(plan: Plan, tensors: Sequence[torch.Tensor], stream: Any) -> None:
    """Off the training path (``prepare``): launch, once, the kinds of copies a snapshot
    makes - a multi-tensor device-to-device copy per dtype, a host-to-device copy of a
    small CPU tensor - on the snapshot's stream, with tiny tensors of its own (the buffer
    and the state are not touched). CUDA loads a kernel at its first launch, on the host
    thread that launches it; the first save of a process would otherwise pay that while
    the optimizer step waits for its copies to be enqueued. (In both GPU runs the first
    save of a process staged ~15 ms later than every later one; how much of that this
    takes off is unmeasured.)"""
    dtypes = list(dict.fromkeys(tensors[i].dtype for i in plan.gpu))
    with torch.cuda.device(plan.device), torch.cuda.stream(stream):
        dst = [torch.empty(4, dtype=d, device=plan.device) for d in dtypes]
        src = [torch.zeros(4, dtype=d, device=plan.device) for d in dtypes]
        try:
            torch._foreach_copy_(dst, src)
        except (RuntimeError, AttributeError, TypeError):
            for a, b in zip(dst, src):
                a.copy_(b)
        for i, into in plan.inside.items():
            torch.empty_like(into).copy_(tensors[i].detach())
        ev = torch.cuda.Event()
        ev.record(stream)
    ev.synchronize()


def snap(plan: Plan, tensors: Sequence[torch.Tensor], stream: Any, start: Any) -> Any:
    """Enqueue the device-to-device copies on ``stream`` after ``start``; returns the event
    the optimizer step waits for."""
    srcs = [tensors[i] for i in plan.gpu]
    if plan.filled is not None:
        stream.wait_event(plan.filled)
    if start is not None:
        stream.wait_event(start)
    else:  # save() did not mark this device: order after all its work so far
        stream.wait_stream(torch.cuda.current_stream(plan.device))
    with torch.cuda.device(plan.device), torch.cuda.stream(stream):
        try:
            torch._foreach_copy_(plan.views, srcs)  # a few kernel launches for many tensors
        except (RuntimeError, AttributeError, TypeError):
            for dst, src in zip(plan.views, srcs):
                dst.copy_(src)
        ev = torch.cuda.Event()
        ev.record(stream)
    return ev


def drain(
    device: int, lo: int, runs: Sequence[tuple[int, int]], buf: torch.Tensor, slot_buf: torch.Tensor, stream: Any,
    chunk: int, copied: Any = None,
) -> list[str]:
    """:func:`copy_out`, then the digests of the whole file once every chunk is hashed."""
    return [f.result() for f in copy_out(device, lo, runs, buf, slot_buf, stream, chunk, copied)]


def copy_out(
    device: int, lo: int, runs: Sequence[tuple[int, int]], buf: torch.Tensor, slot_buf: torch.Tensor, stream: Any,
    chunk: int, copied: Any = None,
) -> list[Future[str]]:
    """Copy every run (file ranges; the buffer starts at file offset ``lo``) to the slot
    in ``PIECE``-byte copies, at most ``WINDOW`` in flight, and hash each ``chunk`` of the
    file as soon as the copies have passed it. Returns once every copy has landed (after
    calling ``copied()``: the buffer may be written again from then on), with the futures
    of the whole file's chunk digests, the last of them still being hashed (the header and
    bytes outside the runs must be in the slot already).

    The pieces exist so hashing can start while the drain goes on. (They do not spare a
    training loop's ``loss.item()`` the wait for a drain its own process enqueued:
    ``bench/gpu_overlap.py``; hence :mod:`incluster.staging.remote_drain`.)"""
    front = Frontier(slot_buf.numpy(), slot_buf.numel(), chunk)
    flight: deque[tuple[int, Any]] = deque()
    done_to = lo  # every byte below this is in the slot

    with torch.cuda.device(device), torch.cuda.stream(stream):
        for a, b in runs:
            for at in range(a, b, PIECE):
                end = min(b, at + PIECE)
                slot_buf[at:end].copy_(buf[at - lo : end - lo], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                flight.append((end, ev))
                while len(flight) > WINDOW:
                    done_to, first = flight.popleft()
                    first.synchronize()
                    front.advance(done_to)
    while flight:
        done_to, ev = flight.popleft()
        ev.synchronize()
    front.advance(front.size)
    if copied is not None:
        copied()
    return front.futures
