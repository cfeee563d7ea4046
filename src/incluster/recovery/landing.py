"""Where a restored shard's bytes land: straight in the live tensors, checked as they land.

A shard file is its header followed by its tensors back to back (the strict reader
rejects holes). A restore cuts it into segments - the header, every tensor of at least
``big`` bytes, and the runs of smaller tensors between them - and lands each segment
either in the live tensor that ``load_into`` would copy it into (a plain, contiguous CPU
tensor of the stored dtype and shape that overlaps no other target) or in scratch
memory. Every byte is hashed right after it lands, chunk by chunk against the sidecar's
digests, so the bytes are read once and hashed while still in the cache.

IMPORTANT: a mismatch is found only after earlier chunks were written into the live
tensors. The caller must then restore from another copy (which overwrites every target
again) or report that the live state was partly overwritten; it must never leave it as is.
"""

from __future__ import annotations

import bisect
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from incluster.errors import CorruptCheckpointError
from incluster.format.checksum import Checksum, ChunkVerifier
from incluster.format.dtypes import NAME_TO_DTYPE
from incluster.format.reader import ShardHeader
from incluster.state_load import live_targets, mismatch

BIG = 256 * 1024  # tensors at least this big get a segment of their own
PIECE = 1 << 20  # local reads copy and hash this much at a time (it stays in the cache)
_HUGE = 2 << 20


@dataclass(frozen=True)
class Segment:
    offset: int
    nbytes: int
    name: str | None  # the one tensor it holds; None: the header or a run of small tensors


def segments(header: ShardHeader, big: int = BIG) -> list[Segment]:
    """The file cut into segments, in file order (both ends of a transfer cut it alike)."""
    out = [Segment(0, header.data_start, None)]
    run: int | None = None
    for t in sorted(header.tensors.values(), key=lambda t: t.offset):
        if t.nbytes >= big:
            if run is not None:
                out.append(Segment(run, t.offset - run, None))
                run = None
            out.append(Segment(t.offset, t.nbytes, t.name))
        elif run is None and t.nbytes:
            run = t.offset
    if run is not None:
        out.append(Segment(run, header.file_size - run, None))
    return out


def direct_targets(
    state: Mapping[str, Any],
    tree: Any,
    header: ShardHeader,
    *,
    allow_pickle: bool,
    big: int = BIG,
    devices: tuple[str, ...] = ("cpu",),
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Live tensors that can take their stored bytes as they are (see the module doc);
    ``devices``: where such a tensor may live ("cuda" ones land through
    :mod:`incluster.recovery.device_landing`). ``strict``: a live tensor of another shape
    or dtype than its stored one is refused here, before any byte lands (a reshard, whose
    DTensor shards differ in shape by design, checks its own)."""
    spans = []
    for name, t in live_targets(state, tree, allow_pickle=allow_pickle).items():
        st = header.tensors.get(name)
        if st is not None and strict:
            mismatch(name, t, NAME_TO_DTYPE[st.dtype], st.shape)  # before any byte lands anywhere
        if st is None or st.nbytes < big or st.nbytes == 0:
            continue
        if (
            t.device.type not in devices
            or t.layout != torch.strided
            or not t.is_contiguous()
            or t.dtype != NAME_TO_DTYPE[st.dtype]
            or tuple(t.shape) != st.shape
            or t.is_conj()
            or t.is_neg()
        ):
            continue
        spans.append((t.data_ptr(), t.data_ptr() + st.nbytes, name, t))
    spans.sort(key=lambda s: s[0])
    out: dict[str, torch.Tensor] = {}
    reach = -1  # the highest end of the spans before this one
    for i, (lo, hi, name, t) in enumerate(spans):
        nxt = spans[i + 1][0] if i + 1 < len(spans) else hi
        if lo >= reach and hi <= nxt:  # overlapping targets: let load_into copy them in order
            out[name] = t
        reach = max(reach, hi)
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class Landing:
    """One destination per segment: a live tensor's bytes or a piece of scratch memory."""

    def __init__(self, header: ShardHeader, segs: list[Segment], targets: Mapping[str, torch.Tensor]) -> None:
        self.header, self.segs = header, segs
        self.devices: list[torch.device] = []  # where the non-CPU destinations are
        self.placed = {s.name: targets[s.name] for s in segs if s.name is not None and s.name in targets}
        n = sum(s.nbytes for s in segs if s.name not in self.placed)
        if n >= _HUGE:  # huge pages where the kernel allows: far fewer faults than 4 KiB ones
            mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                mm.madvise(mmap.MADV_HUGEPAGE)
            self._scratch = torch.frombuffer(mm, dtype=torch.uint8)
        else:
            self._scratch = torch.empty(n, dtype=torch.uint8)
        self.dests: list[torch.Tensor] = []
        self._starts: list[int] = []  # file offsets of the scratch segments
        self._at: list[int] = []  # their positions in the scratch buffer
        pos = 0
        for s in segs:
            if s.name in self.placed:
                dest = _bytes_of(self.placed[s.name])  # type: ignore[index]
                if dest.device.type != "cpu" and dest.device not in self.devices:
                    self.devices.append(dest.device)
                self.dests.append(dest)
            else:
                self.dests.append(self._scratch[pos : pos + s.nbytes])
                self._starts.append(s.offset)
                self._at.append(pos)
                pos += s.nbytes

    @property
    def nbytes(self) -> int:
        return self.header.file_size

    def fetch(self, name: str) -> torch.Tensor:
        """A stored tensor that did not land in place (a view of the scratch memory)."""
        t = self.header.tensors.get(name)
        if t is None:
            raise CorruptCheckpointError(f"the state tree names tensor {name!r} but the shard lacks it")
        if name in self.placed:
            return self.placed[name]
        i = bisect.bisect_right(self._starts, t.offset) - 1
        at = self._at[i] + t.offset - self._starts[i]
        return self._scratch[at : at + t.nbytes].view(NAME_TO_DTYPE[t.dtype]).view(t.shape)


def _pread_full(fd: int, view: memoryview, offset: int, where: str) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise CorruptCheckpointError(f"{where}: the file ended at byte {offset} (truncated while read)")
        view, offset = view[n:], offset + n


def read_verified(
    fd: int, landing: Landing, expected: Checksum, where: str, workers: int = 1, *, bounce_cpu: bool = False
) -> None:
    """Read the whole shard from ``fd`` into ``landing``, each piece hashed right after
    it is copied; chunks run on up to ``workers`` threads (the copies and hashes release
    the GIL). Raises CorruptCheckpointError at the first chunk that differs. GPU
    destinations go through page-locked bounce buffers; ``bounce_cpu`` sends CPU tensor
    destinations the same way (the pipeline's test on machines without a GPU)."""
    if expected.size != landing.nbytes:
        raise CorruptCheckpointError(f"{where}: the header says {landing.nbytes} bytes, the sidecar {expected.size}")
    chunk = expected.chunk
    starts = [s.offset for s in landing.segs]
    views = [memoryview(d.numpy()) if d.device.type == "cpu" else None for d in landing.dests]  # type: ignore[arg-type]
    # One pool of bounce buffers per destination device, their streams on it: a copy into
    # a tensor runs on a stream of the tensor's device, so only that device's buffers'
    # events say when the copy has read its buffer.
    pools: dict[torch.device, tuple[Any, Any]] = {}
    if landing.devices or bounce_cpu:
        from incluster.recovery.device_landing import bounce_for, compute_mark

        for dev in landing.devices + ([torch.device("cpu")] if bounce_cpu else []):
            pools[dev] = (bounce_for(dev, max(1, workers)), compute_mark(dev))

    def one(k: int) -> None:
        lo, hi = k * chunk, min((k + 1) * chunk, expected.size)
        v = ChunkVerifier(expected, where, first=k)
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(starts) and starts[i] < hi:
            seg, view = landing.segs[i], views[i]
            pos = max(lo, seg.offset)
            end = min(hi, seg.offset + seg.nbytes)
            if view is None or (bounce_cpu and seg.name is not None):
                dest = landing.dests[i]
                bounce, after = pools[dest.device]
                _through(bounce, fd, pos, end, seg, dest, v, where, after)
                pos = end
            while pos < end and view is not None:
                piece = view[pos - seg.offset : min(end, pos + PIECE) - seg.offset]
                _pread_full(fd, piece, pos, where)
                v.update(piece)
                pos += piece.nbytes
            i += 1
        v.finish(hi)

    count = max(1, -(-expected.size // chunk))
    try:
        if workers <= 1 or count == 1:
            for k in range(count):
                one(k)
            return
        with ThreadPoolExecutor(min(workers, count), thread_name_prefix="incluster-restore") as pool:
            for f in [pool.submit(one, k) for k in range(count)]:
                f.result()
    finally:
        for bounce, _ in pools.values():
            bounce.finish()  # every copy landed (or, after an error, none still reads a buffer)


def _through(bounce: Any, fd: int, pos: int, end: int, seg: Segment, dest: torch.Tensor, v: Any, where: str,
             after: Any = None) -> None:
    """File range [pos, end) of ``seg`` into ``dest`` via the bounce buffers: each piece
    read and hashed in a page-locked buffer, then copied over without waiting."""
    while pos < end:
        b = bounce.take()
        n = min(end - pos, bounce.size)
        at = 0
        try:
            while at < n:
                piece = b.view[at : min(n, at + PIECE)]
                _pread_full(fd, piece, pos + at, where)
                v.update(piece)
                at += piece.nbytes
        except BaseException:
            bounce.give_back(b)  # a pool that lost its buffers would hang the next restore
            raise
        bounce.send(b, n, dest[pos - seg.offset : pos - seg.offset + n], after)
        pos += n
