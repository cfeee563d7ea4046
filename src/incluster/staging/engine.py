"""The staging engine: flatten a snapshot, place it in a slot, copy tensors into it.

Runs on one background thread per Checkpointer. For each save it flattens the snapshot
taken by ``save()``, looks the layout up by structure (built once per structure), makes
sure the slot is mapped at the right size and carries the layout's header, then copies:
CPU tensors with plain memcpys (or ``copy_``) into cached views of the one mapping; GPU
tensors either into the device-side snapshot (:mod:`incluster.staging.device_snapshot`:
device-to-device, ``staged`` as soon as that is done, then drained to the page-locked
slot) or, without room for it, device-to-host straight into the slot on a side stream
(:mod:`incluster.staging.cuda`). Slots are sized, mapped and page-locked ahead of the
save that takes them (``ready``), so a save in steady state only copies.

IMPORTANT: no collectives and no blocking on other ranks here; this thread only copies.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from incluster.format.checksum import DEFAULT_CHUNK, Frontier
from incluster.format.dtypes import NAME_TO_DTYPE
from incluster.format.layout import Layout, LayoutCache
from incluster.staging.slots import Slot, SlotRing, allocated
from incluster.flat_fast import FastFlattener
from incluster.state import Flat

log = logging.getLogger("incluster")
SMALL_COPY = 16 * 1024 * 1024  # bytes; larger tensors use torch's multi-threaded copy


@dataclass
class StageJob:
    """One save on its way through staging."""

    step: int
    snap: Any
    slot: Slot
    cuda_start: dict[int, Any] = field(default_factory=dict)  # device -> event save() recorded
    # Set once every CPU copy is done and every GPU copy is enqueued: the pre-step hook
    # waits on it (briefly), then orders each GPU's compute stream after ``cuda_done``.
    host_done: threading.Event = field(default_factory=threading.Event)
    cuda_done: list[tuple[int, Any]] = field(default_factory=list)  # (device, event) of the copies
    staged: Future[None] = field(default_factory=Future)
    staged_at: float | None = None  # perf_counter() when ``staged`` resolved
    flat: Flat | None = None
    layout: Layout | None = None
    ordinal: int = 0  # how many save() calls this Checkpointer took before this one
    prev: int = -1  # the step of this rank's previous save() call (CommitRequest.prev)
    timeline: int = 0  # load() calls before it (CommitRequest.timeline)
    lineage: tuple[int, int, int] = (0, 0, -1)  # CommitRequest.lineage
    persist: bool | None = None  # save(persist=): CommitRequest.persist
    digests: list[str] | tuple[str, ...] | None = None  # the shard's chunk digests, if hashed here
    drain: tuple[int, int, tuple[tuple[int, int], ...]] | None = None  # left to the writer (CommitRequest.drain)
    # Direct copies of a state on one GPU: (i, event) once GPU copies 0..i have landed, and
    # per i the offset below which every byte is then in the slot (see hash_behind)
    marks: list[tuple[int, Any]] = field(default_factory=list)
    mark_starts: list[int] = field(default_factory=list)

    def mark_staged(self) -> None:
        """The state may change from now on (its bytes are out, or in the device snapshot)."""
        if self.staged_at is None:
            self.staged_at = time.perf_counter()
        try:
            self.staged.set_result(None)
        except InvalidStateError:
            pass  # already resolved (or failed by another thread): nothing to add


def landed_below(base: Any, dsts: list[torch.Tensor], size: int) -> list[int]:
    """Per GPU copy ``i`` (into ``dsts[i]``, a view of the slot ``base``): the lowest file
    offset a later copy writes, i.e. once copies 0..i have landed (and every CPU copy and
    the header, done before the hashing starts) every byte below it is in the slot."""
    out, low = [0] * len(dsts), size
    origin = base.data_ptr()
    for i in range(len(dsts) - 1, -1, -1):
        out[i] = low
        low = min(low, dsts[i].data_ptr() - origin)
    return out


def hash_behind(front: Frontier, marks: list[tuple[int, Any]], starts: list[int]) -> None:
    """Wait for each mark in turn (in stream order), hashing every chunk that is then in."""
    for i, ev in marks:
        ev.synchronize()
        front.advance(starts[i])


@torch.no_grad()
def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    try:
        torch._foreach_copy_(dsts, srcs)
    except (RuntimeError, AttributeError, TypeError):  # a torch without it, or a pair it will not take
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)


def gpu_devices(tensors: list[torch.Tensor], kinds: list[str] | None = None) -> tuple[int, ...] | None:
    """The GPUs the tensors of kind "g" (all, without ``kinds``) are on, for
    ``cuda.record_start`` - only where torch cannot tell it which GPUs are in use (None
    elsewhere: a pass over every tensor per save, not made for nothing)."""
    from incluster.staging import cuda

    if cuda.CAN_TELL:
        return None
    return tuple(sorted({t.get_device() for t, k in zip(tensors, kinds or ["g"] * len(tensors)) if k == "g"}))


def make_views(buf: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Typed, shaped views into the mapping, one per layout entry (input order)."""
    views = []
    for e in layout.entries:
        raw = buf[e.offset : e.offset + e.nbytes]
        views.append(raw.view(NAME_TO_DTYPE[e.spec.dtype]).view(e.spec.shape))
    return views


class Stager:
    """Turns a :class:`StageJob` into bytes in its slot; owns the layout cache, whether
    slots are page-locked (``pin``: once a save holds CUDA tensors) and the device-side
    snapshot (``gpu_snapshot``: None automatic, 0 off, else a byte budget)."""

    def __init__(self, ring: SlotRing, allow_pickle: bool, gpu_snapshot: int | None = None) -> None:
        self.ring = ring
        self.allow_pickle = allow_pickle
        self.gpu_snapshot = gpu_snapshot
        self.layouts = LayoutCache()
        self.flattener = FastFlattener(allow_pickle)  # names and specs once per structure
        self.pin = False
        self.cuda_device: int | None = None  # the GPU the saved state is on: slots page-lock there
        # Where torch cannot tell which GPUs are in use: those the last save's (or prepare's)
        # state was on, for save() to mark (None: not needed, or not known yet)
        self.cuda_devices: tuple[int, ...] | None = None
        self.replica_slots = 0  # slots this rank's writer keeps for its partners' replicas
        self._said_size: int | None = None  # the shard size whose RAM was said (once per size)
        self._cuda: Any = None
        self._device: Any = None  # device_snapshot.DeviceSnapshots, at the first GPU save
        self._helper: ThreadPoolExecutor | None = None
        self.remote: Any = None  # remote_drain.RemoteDrain: the writer process drains (gpu_drain="writer")
        self.remote_timeout_s = 300.0
        self.hand_over_waiting: Any = lambda: False  # whether saves wait for the writer's start

    @property
    def device_active(self) -> bool:
        return bool(self._device is not None and self._device.active)

    def run(self, job: StageJob) -> None:
        try:
            self._run(job)
        except BaseException:
            self._settle(job)
            raise

    def _settle(self, job: StageJob) -> None:
        """After a staging error: wait for every copy this thread enqueued (those with an
        event in ``job.cuda_done`` and any other, a drain's or one of a device whose
        enqueue failed half way). They still write into the slot and read the state: the
        slot must not be handed out, re-mapped or unregistered before they land."""
        waits = [ev for _, ev in job.cuda_done]
        if self._cuda is not None:
            waits += list(self._cuda.streams())
        for w in waits:
            try:
                w.synchronize()
            except Exception:  # noqa: BLE001 - the error being raised says more
                pass

    @torch.no_grad()  # a Parameter copied into the slot must not tie it into the autograd graph
    def _run(self, job: StageJob) -> None:
        plan: Any = None
        after: list[tuple[int, torch.Tensor]] = []
        try:
            flat = self.flattener.flatten(job.snap)
            job.snap = None  # drop references to live tensors as soon as possible
            job.flat = flat
            layout = job.layout = self.layouts.get(tuple(flat.specs))
            kinds = self.kinds(flat.tensors)
            if "g" in kinds:
                self.pin_for(flat.tensors[kinds.index("g")])
                self.cuda_devices = gpu_devices(flat.tensors, kinds)
                if self.remote is not None:  # the writer is done reading the buffer
                    self.remote.wait_free(self.remote_timeout_s)
                plan = self._devices().plan(layout, flat.tensors, kinds)
            if plan is None:
                self._copy_direct(job, flat.tensors, layout)
                if not job.cuda_done:
                    # Every byte is in the slot: staged before the pre-step hook is released,
                    # so a step that waited finds ``handle.staged`` resolved.
                    job.mark_staged()
            else:
                after = self._snap(job, flat.tensors, layout, kinds, plan)
        finally:
            job.host_done.set()
        pipelined = bool(job.marks) and plan is None and job.slot.buf is not None
        if not pipelined:
            for _, ev in job.cuda_done:
                ev.synchronize()
        if plan is not None:
            # Device-to-device done: the optimizer may step. The drain to the slot follows.
            job.mark_staged()
            from incluster.staging import cuda
            from incluster.staging.device_snapshot import drain

            views = self._views(job.slot, layout)  # maps (and page-locks) a slot not warmed yet
            # Not while saves wait for the writer's start (handover): this one's hand-off
            # would queue behind them, and the next save wait for its drain on this thread.
            remote = self.remote is not None and not self.hand_over_waiting() and self.remote.offer(self._device.buf)
            if not remote:
                cuda.register(job.slot, self.cuda_device)
            stream = self._copier().stream(plan.device)
            with torch.cuda.device(plan.device), torch.cuda.stream(stream):
                for i, clone in after:  # before the drain, in stream order
                    (plan.inside[i] if i in plan.inside else views[i]).copy_(clone)
            if remote:  # the writer process copies and hashes (see remote_drain)
                stream.synchronize()  # the small tensors are in the buffer before it reads
                job.drain = (self.remote.buf_id, plan.lo, tuple(plan.runs))
                self.remote.begin(job.step)
            else:
                job.digests = drain(plan.device, plan.lo, plan.runs, self._device.buf, job.slot.buf, stream,  # type: ignore[arg-type]
                                    DEFAULT_CHUNK)
        elif job.cuda_done and job.slot.buf is not None:
            # Hashing here, in parallel, spares the writer process a pass (and a first
            # mapping with its page tables) per slot; each chunk as soon as the copies have
            # passed it, so the hashing overlaps the copy instead of following it.
            front = Frontier(job.slot.buf.numpy(), layout.total_size, DEFAULT_CHUNK)
            if pipelined:
                hash_behind(front, job.marks, job.mark_starts)
            job.mark_staged()  # every byte is in the slot
            job.digests = front.digests()
        flat.tensors = []  # the bytes are in the slot now; let go of the live tensors

    def pin_for(self, gpu_tensor: torch.Tensor) -> None:
        """Slots are page-locked from now on, in the context of ``gpu_tensor``'s GPU."""
        self.pin = True
        if self.cuda_device is None:
            self.cuda_device = gpu_tensor.device.index or 0

    @staticmethod
    def kinds(tensors: list[torch.Tensor]) -> list[str]:
        """Per tensor: "g" on a GPU, "s" a small CPU tensor, "c" a large CPU one."""
        from incluster.staging.device_snapshot import SMALL_CPU

        return ["g" if t.is_cuda else "s" if t.nbytes <= SMALL_CPU else "c" for t in tensors]

    def _copy_direct(self, job: StageJob, tensors: list[torch.Tensor], layout: Layout) -> None:
        """Every tensor straight into the slot: GPU ones device-to-host on the side stream."""
        views = self._views(job.slot, layout)
        small_dst: list[torch.Tensor] = []
        small_src: list[torch.Tensor] = []
        large: list[tuple[torch.Tensor, torch.Tensor]] = []
        gpu: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in zip(views, tensors):
            if src.is_cuda:
                gpu.append((dst, src))
            elif src.nbytes <= SMALL_COPY:
                small_dst.append(dst)
                small_src.append(src)
            else:
                large.append((dst, src))
        if gpu:
            from incluster.staging import cuda

            cuda.register(job.slot, self.cuda_device)
            job.cuda_done = self._copier().enqueue(gpu, job.cuda_start, job.marks)
            job.mark_starts = landed_below(job.slot.buf, [d for d, _ in gpu], job.slot.size)
        self._copy_small(small_dst, small_src)
        for dst, src in large:
            dst.copy_(src)

    def _snap(
        self, job: StageJob, tensors: list[torch.Tensor], layout: Layout, kinds: list[str], plan: Any
    ) -> list[tuple[int, torch.Tensor]]:
        """Device-side snapshot: enqueue the GPU copies first, then the CPU tensors (large
        ones straight into the slot, small ones cloned, put in place before the drain)."""
        from incluster.staging.device_snapshot import snap

        stream = self._copier().stream(plan.device)
        job.cuda_done = [(plan.device, snap(plan, tensors, stream, job.cuda_start.get(plan.device)))]
        if "c" in kinds:
            views = self._views(job.slot, layout)
            for i, k in enumerate(kinds):
                if k == "c":
                    views[i].copy_(tensors[i])
        return [(i, tensors[i].detach().clone()) for i, k in enumerate(kinds) if k == "s"]

    @torch.no_grad()
    def prepare_for(self, tensors: list[torch.Tensor], layout: Layout) -> None:
        """``Checkpointer.prepare``: page-lock from now on if the state is on a GPU, and
        take the device-side snapshot buffer now rather than at the first save."""
        kinds = self.kinds(tensors)
        if "g" in kinds:
            self.pin_for(tensors[kinds.index("g")])
            self.cuda_devices = gpu_devices(tensors, kinds)
            plan = self._devices().plan(layout, tensors, kinds)
            if plan is not None:
                from incluster.staging.device_snapshot import warm

                try:
                    warm(plan, tensors, self._copier().stream(plan.device))
                except Exception as exc:  # noqa: BLE001 - an optimisation only: the save copies anyway
                    log.debug("incluster: the snapshot's copies were not warmed: %s", exc)

    def release_device(self) -> None:
        """After close(): free the device-side snapshot (the writer has let go of it)."""
        if self._device is not None and self._device.buf is not None:
            self._device.free()
            if self.remote is not None:
                self.remote.forget()
            torch.cuda.ipc_collect()  # memory the writer process held is freed now, not at exit

    def offer_remote(self) -> None:
        """Off the training path: share the device-side snapshot with the writer process
        now, so the next save's drain already runs there."""
        if self.remote is not None and self._device is not None and self._device.buf is not None:
            self.remote.offer(self._device.buf)

    def pin_remote(self) -> None:
        """Off the training path: the writer process page-locks the slots mapped since it
        opened the snapshot (``RemoteDrain.pin_ahead``)."""
        if self.remote is not None:
            self.remote.pin_ahead()

    def ready(self, slot: Slot, layout: Layout) -> None:
        """Off the training path: the slot sized, mapped, headed for ``layout`` (and
        page-locked when ``pin``), so the save that takes it next only copies."""
        self._views(slot, layout)
        if self.pin:
            from incluster.staging import cuda

            cuda.register(slot, self.cuda_device)

    def map_ahead(self, slot: Slot, size: int) -> None:
        """Map (and page-lock when ``pin``) a slot still holding a committed step at its own
        size: no byte of it is written; the save that takes it writes its header. Retention
        on another thread leaves it alone meanwhile (``warming``, set by ``next_taken``)."""
        try:
            self.ring.prepare(slot, size)
            if self.pin:
                from incluster.staging import cuda

                cuda.register(slot, self.cuda_device)
        finally:
            self.ring.warmed(slot)

    def _devices(self) -> Any:
        if self._device is None:
            from incluster.staging.device_snapshot import DeviceSnapshots

            self._device = DeviceSnapshots(self.gpu_snapshot)
        return self._device

    def _copier(self) -> Any:
        if self._cuda is None:
            from incluster.staging import cuda

            self._cuda = cuda.CudaCopier()
        return self._cuda

    def _copy_small(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Many small copies in a few calls (``torch._foreach_copy_``: one C++ loop, the
        GIL released), split over two threads by bytes.

        Per tensor from Python, a copy cost 3-10 us on the staging thread whichever way
        (numpy views of each source, or ``copy_``), 2,700 tensors 25-45 ms; one call for
        them all costs ~1 us a tensor. Two threads reach the bandwidth one large
        multi-threaded copy gets."""
        if not dsts:
            return
        sizes = [d.nbytes for d in dsts]
        total = sum(sizes)
        half, acc, cut = total // 2, 0, len(dsts)
        for i, n in enumerate(sizes):
            acc += n
            if acc >= half:
                cut = i + 1
                break
        if total < (8 << 20) or cut >= len(dsts):
            _copy_all(dsts, srcs)
            return
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="incluster-copy")
        other = self._helper.submit(_copy_all, dsts[cut:], srcs[cut:])
        _copy_all(dsts[:cut], srcs[:cut])
        other.result()

    def _check_room(self, size: int) -> None:
        """Warn when the slots still to be made will not fit in the RAM disk's free space
        (saves then keep fewer steps than ``keep``; see ``saving._fit_ring``)."""
        try:
            st = os.statvfs(self.ring.folder)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        made = sum(allocated(s.path) for s in self.ring.slots)  # adopted ones too: their RAM is on disk
        need = self.ring.keep * size - made
        if need <= free:
            return
        where = os.path.dirname(self.ring.folder)
        if 2 * size - made > free:  # not even the two slots a save needs beside the newest step
            log.warning(
                "incluster: this rank's checkpoint slots need %.1f MiB more of %s, and only %.1f MiB are free there: "
                "saves need room for at least 2 slots of %.1f MiB (the newest step stays while the next is "
                "written), so saves will fail until %.1f MiB more are free; free space there or point local_dir "
                "elsewhere", _mib_up(need), where, _mib_down(free), size / 2**20, _mib_up(2 * size - made - free))
        else:
            log.warning(
                "incluster: this rank's checkpoint slots need about %.1f MiB more of %s, but only %.1f MiB are free "
                "there: fewer steps than keep=%d will be kept (every save still lands); free space, or point "
                "local_dir elsewhere", _mib_up(need), where, _mib_down(free), self.ring.keep)

    def _views(self, slot: Slot, layout: Layout) -> list[torch.Tensor]:
        if self._said_size != layout.total_size:  # said again when the state grows (prepare() too early)
            self._said_size = layout.total_size
            mib = layout.total_size / 2**20
            log.info(
                "incluster: shard is %.1f MiB; this rank takes about %.1f MiB of %s: %d slot files of its "
                "own (%.1f MiB, allocated once) and %d for its replication partners' shards (if alike in size)",
                mib, (self.ring.keep + self.replica_slots) * mib, os.path.dirname(self.ring.folder), self.ring.keep,
                self.ring.keep * mib, self.replica_slots,
            )
            self._check_room(layout.total_size)
        buf = self.ring.prepare(slot, layout.total_size)
        if slot.header_fp != layout.fingerprint:
            header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
            buf[: len(layout.header)].copy_(header)
            slot.views = make_views(buf, layout)
            slot.header_fp = layout.fingerprint
        return slot.views


def _mib_up(nbytes: int) -> float:
    """MiB rounded up to the 0.1 shown: a shortfall of a few KiB reads 0.1, never 0.0."""
    return math.ceil(max(nbytes, 1) / 2**20 * 10) / 10


def _mib_down(nbytes: int) -> float:
    """MiB rounded down to the 0.1 shown: room just short of what is needed never reads as enough."""
    return math.floor(max(nbytes, 0) / 2**20 * 10) / 10
