"""The staging engine: flatten a snapshot, place it in a slot, copy tensors into it.

Runs on one background thread per Checkpointer. For each save it flattens the snapshot
taken by ``save()``, looks the layout up by structure (built once per structure), makes
sure the slot is mapped at the right size and carries the layout's header, then copies:
GPU tensors through :mod:`incluster.staging.cuda` on a side stream, CPU tensors with a
plain loop of ``copy_`` calls into cached views of the one mapping (torch releases the
GIL inside each copy).

IMPORTANT: no collectives and no blocking on other ranks here; this thread only copies.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from incluster.format.dtypes import NAME_TO_DTYPE
from incluster.format.layout import Layout, LayoutCache
from incluster.staging.slots import Slot, SlotRing
from incluster.state import Flat, flatten_snapshot

log = logging.getLogger("incluster")
SMALL_COPY = 16 * 1024 * 1024  # bytes; larger tensors use torch's multi-threaded copy


@dataclass
class StageJob:
    """One save on its way through staging."""

    step: int
    snap: Any
    slot: Slot
    cuda_start: dict[int, Any] = field(default_factory=dict)
    # Set once every CPU copy is done and every GPU copy is enqueued: the pre-step hook
    # waits on it (briefly), then orders the compute stream after ``cuda_done``.
    host_done: threading.Event = field(default_factory=threading.Event)
    cuda_done: list[Any] = field(default_factory=list)
    staged: Future[None] = field(default_factory=Future)
    flat: Flat | None = None
    layout: Layout | None = None
    ordinal: int = 0  # how many save() calls this Checkpointer took before this one


def make_views(buf: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Typed, shaped views into the mapping, one per layout entry (input order)."""
    views = []
    for e in layout.entries:
        raw = buf[e.offset : e.offset + e.nbytes]
        views.append(raw.view(NAME_TO_DTYPE[e.spec.dtype]).view(e.spec.shape))
    return views


class Stager:
    """Turns a :class:`StageJob` into bytes in its slot; owns the layout cache."""

    def __init__(self, ring: SlotRing, allow_pickle: bool) -> None:
        self.ring = ring
        self.allow_pickle = allow_pickle
        self.layouts = LayoutCache()
        self._cuda: Any = None
        self._helper: ThreadPoolExecutor | None = None

    def run(self, job: StageJob) -> None:
        try:
            flat = flatten_snapshot(job.snap, allow_pickle=self.allow_pickle)
            job.snap = None  # drop references to live tensors as soon as possible
            job.flat = flat
            layout = job.layout = self.layouts.get(tuple(flat.specs))
            views = self._views(job.slot, layout)
            cpu: list[tuple[torch.Tensor, torch.Tensor]] = []
            gpu: list[tuple[torch.Tensor, torch.Tensor]] = []
            raws = job.slot.raw_views
            small: list[tuple[Any, Any]] = []
            for i, (dst, src) in enumerate(zip(views, flat.tensors)):
                if src.is_cuda:
                    gpu.append((dst, src))
                elif src.is_contiguous() and src.dtype is dst.dtype and raws[i].nbytes <= SMALL_COPY:
                    small.append((raws[i], src.detach().reshape(-1).view(torch.uint8).numpy()))
                else:
                    cpu.append((dst, src))
            if gpu:
                job.cuda_done = self._enqueue_cuda(job, gpu)
            self._copy_small(small)
            for dst, src in cpu:
                dst.copy_(src)
        finally:
            job.host_done.set()
        for ev in job.cuda_done:
            ev.synchronize()
        flat.tensors = []  # the bytes are in the slot now; let go of the live tensors

    def _copy_small(self, pairs: list[tuple[Any, Any]]) -> None:
        """Plain memcpys (numpy releases the GIL), split over two threads by bytes.

        One memcpy per tensor, no intra-op thread team started per tensor: torch's copy_
        made 2,000 small copies ~2x slower from a background thread. Two threads reach
        the bandwidth a single large multi-threaded copy gets."""
        if not pairs:
            return
        total = sum(d.nbytes for d, _ in pairs)
        half, acc, cut = total // 2, 0, len(pairs)
        for i, (d, _) in enumerate(pairs):
            acc += d.nbytes
            if acc >= half:
                cut = i + 1
                break

        def run(part: list[tuple[Any, Any]]) -> None:
            for d, src in part:
                np.copyto(d, src)

        if total < (8 << 20) or cut >= len(pairs):
            run(pairs)
            return
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="incluster-copy")
        other = self._helper.submit(run, pairs[cut:])
        run(pairs[:cut])
        other.result()

    def _views(self, slot: Slot, layout: Layout) -> list[torch.Tensor]:
        if self.layouts.misses == 1 and self.layouts.hits == 0:
            log.info(
                "incluster: shard is %.1f MiB; staging uses %d slot files = %.1f MiB of %s, allocated once",
                layout.total_size / 2**20, self.ring.keep, self.ring.keep * layout.total_size / 2**20, self.ring.folder,
            )
        buf = self.ring.prepare(slot, layout.total_size)
        if slot.header_fp != layout.fingerprint:
            header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
            buf[: len(layout.header)].copy_(header)
            slot.views = make_views(buf, layout)
            slot.raw_views = [buf[e.offset : e.offset + e.nbytes].numpy() for e in layout.entries]
            slot.header_fp = layout.fingerprint
        return slot.views

    def _enqueue_cuda(self, job: StageJob, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        from incluster.staging import cuda

        if self._cuda is None:
            self._cuda = cuda.CudaCopier()
        cuda.register(job.slot)
        return self._cuda.enqueue(pairs, job.cuda_start)
