"""Shard layout: where every tensor's bytes live in a shard file, and the header bytes.

A layout depends only on the state's *structure* (names, dtypes, shapes), so it is
computed once per structure and cached under a fingerprint; later saves of the same
structure reuse header and offsets and only copy bytes (DESIGN §4).

The file is a valid safetensors file: ``u64 header_len | JSON header | data``. The JSON
header is padded with spaces so that the data section starts on a 64-byte boundary, and
tensors are ordered by decreasing element size so every tensor starts at a multiple of
its own element size (safetensors forbids gaps between tensors).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from incluster.format.dtypes import ITEMSIZE

ALIGN = 64
FORMAT_TAG = "incluster"
FORMAT_VERSION = "1"


class TensorSpec(NamedTuple):
    """What the structure of one stored tensor is: its name, dtype name and shape.

    A NamedTuple so a whole structure (a tuple of specs) hashes and compares in C.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Entry:
    """A tensor's place in the file: absolute byte offset and length."""

    spec: TensorSpec
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Entries in *input* order (so entry i belongs to input tensor i), header and sizes."""

    fingerprint: str
    entries: tuple[Entry, ...]
    header: bytes  # the 8-byte length prefix plus the padded JSON header
    data_start: int
    total_size: int


def fingerprint(specs: Sequence[TensorSpec]) -> str:
    """A stable digest of a structure: equal iff names, dtypes and shapes are equal."""
    h = hashlib.blake2b(digest_size=16)
    for s in specs:
        h.update(f"{s.name}\0{s.dtype}\0{','.join(map(str, s.shape))}\n".encode())
    return h.hexdigest()


def build_layout(specs: Sequence[TensorSpec], fp: str | None = None) -> Layout:
    """Place ``specs`` in a file; pure and deterministic."""
    order = sorted(range(len(specs)), key=lambda i: (-ITEMSIZE[specs[i].dtype], i))
    rel: list[int] = [0] * len(specs)
    pos = 0
    table: dict[str, object] = {"__metadata__": {"format": "pt", FORMAT_TAG: FORMAT_VERSION}}
    for i in order:
        s = specs[i]
        rel[i] = pos
        table[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    padded = -(8 + len(raw)) % ALIGN
    raw += b" " * padded
    header = struct.pack("<Q", len(raw)) + raw
    data_start = len(header)
    entries = tuple(Entry(s, data_start + rel[i], s.nbytes) for i, s in enumerate(specs))
    return Layout(
        fingerprint=fp or fingerprint(specs),
        entries=entries,
        header=header,
        data_start=data_start,
        total_size=data_start + pos,
    )


class LayoutCache:
    """Layouts by structure fingerprint. Small: a job has one or two structures."""

    def __init__(self, capacity: int = 8) -> None:
        self._capacity = capacity
        self._layouts: dict[tuple[TensorSpec, ...], Layout] = {}
        self.hits = 0
        self.misses = 0

    def get(self, specs: tuple[TensorSpec, ...]) -> Layout:
        """The layout for ``specs``; built (and fingerprinted) only on a miss."""
        layout = self._layouts.get(specs)
        if layout is not None:
            self.hits += 1
            return layout
        self.misses += 1
        layout = build_layout(specs)
        if len(self._layouts) >= self._capacity:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[specs] = layout
        return layout
