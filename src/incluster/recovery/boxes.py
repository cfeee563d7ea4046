"""Where each rank's piece of a DTensor lies in the global tensor: pure arithmetic, no I/O.

A DTensor shard is a box of the global tensor: an offset and a shape per dimension. It
follows from the global shape, the mesh shape, the placements and the rank's mesh
coordinate alone (DTensor cuts like ``torch.chunk``, one mesh dimension after the other),
so a resharding restore never ships a table of every rank's boxes: each rank computes the
old ranks' boxes and the new ranks' boxes itself. Placements are the JSON form the
sidecar records (:func:`incluster.dtensor.describe`): ``["S", dim]`` and ``["R"]`` are
supported; strided and partial placements are refused with the fix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import prod
from typing import Any, Iterator, Sequence

from incluster.errors import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape)


@dataclass(frozen=True)
class Layout:
    """How one tensor is cut over one mesh (identical on every rank of an SPMD job)."""

    dtype: str
    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, node: dict[str, Any], dtype: str, path: str) -> "Layout":
        """From a tree's DTensor node (and the stored dtype); unsupported cuts are refused."""
        try:
            lay = cls(
                dtype,
                tuple(int(x) for x in node["global_shape"]),
                tuple(int(x) for x in node["mesh_shape"]),
                tuple(tuple(p) for p in node["placements"]),
            )
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: the checkpoint's DTensor record is malformed") from None
        if len(lay.placements) != len(lay.mesh_shape) or any(n <= 0 for n in lay.mesh_shape):
            raise CheckpointError(f"{path}: DTensor placements {lay.placements} do not fit mesh {lay.mesh_shape}")
        for p in lay.placements:
            ok = p == ("R",) or (len(p) == 2 and p[0] == "S" and isinstance(p[1], int) and 0 <= p[1] < len(lay.global_shape))
            if not ok:
                raise CheckpointError(
                    f"{path}: placement {list(p)} cannot be resharded in place (only Shard(dim) and Replicate "
                    f"can); restart with the world size it was saved with, or assemble a full state with "
                    f"`incluster export DIR --step N` and load that"
                )
        return lay

    @property
    def world(self) -> int:
        return prod(self.mesh_shape)

    def box(self, coord: Sequence[int]) -> Box:
        """The box held at mesh coordinate ``coord`` (DTensor's arithmetic)."""
        offset = [0] * len(self.global_shape)
        shape = list(self.global_shape)
        for p, n, c in zip(self.placements, self.mesh_shape, coord):
            if p[0] == "S":
                d = p[1]
                length, start = cut(shape[d], n, c)
                offset[d] += start
                shape[d] = length
        return tuple(offset), tuple(shape)

    def overlapping(self, want: Box, walk_replicated: bool = True) -> Iterator[tuple[tuple[int, ...], Box]]:
        """Every mesh coordinate whose box meets ``want``, with the overlap, in
        coordinate order. Mesh dimensions that cut a tensor dimension nobody else cuts
        are searched arithmetically; the rest are walked (``walk_replicated=False``: a
        replicated mesh dimension only at coordinate 0, which holds the same boxes)."""
        cutters: dict[int, list[int]] = {}
        for i, p in enumerate(self.placements):
            if p[0] == "S":
                cutters.setdefault(p[1], []).append(i)
        ranges = []
        for i, (p, n) in enumerate(zip(self.placements, self.mesh_shape)):
            if p[0] == "S" and len(cutters[p[1]]) == 1:
                d = p[1]
                lo, length = want[0][d], want[1][d]
                if length <= 0:
                    return
                full = -(-self.global_shape[d] // n)
                ranges.append(range(lo // full, min(n, (lo + length - 1) // full + 1)) if full else range(0))
            elif p[0] == "R" and not walk_replicated:
                ranges.append(range(1))
            else:
                ranges.append(range(n))
        for coord in itertools.product(*ranges):
            inter = intersect(self.box(coord), want)
            if inter is not None:
                yield coord, inter

    def replicated_dims(self) -> list[int]:
        """Mesh dimensions along which every coordinate holds the same box."""
        return [i for i, p in enumerate(self.placements) if p[0] == "R"]


def cut(size: int, n: int, c: int) -> tuple[int, int]:
    """(length, start) of chunk ``c`` of ``n`` of a dimension of ``size`` (``torch.chunk``)."""
    full = -(-size // n)
    start = min(size, full * c)
    return max(0, min(size, start + full) - start), start


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``; None when they share no element."""
    off, shape = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        shape.append(hi - lo)
    return tuple(off), tuple(shape)


def local_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Index of box ``inner`` within a local tensor that holds box ``outer``."""
    return tuple(slice(i - o, i - o + s) for i, o, s in zip(inner[0], outer[0], inner[1]))


def coord_of(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Mesh coordinate of ``rank`` in a mesh laid over ranks 0..N-1 in order (what
    ``init_device_mesh`` builds); the caller checks the saved offsets agree."""
    out = []
    for n in reversed(mesh_shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def rank_of(coord: Sequence[int], mesh_shape: Sequence[int]) -> int:
    r = 0
    for c, n in zip(coord, mesh_shape):
        r = r * n + c
    return r


def numel(box: Box) -> int:
    return prod(box[1])
