"""Strict shard reader: parse and validate a shard header before trusting any byte.

Rejects, with a :class:`CorruptCheckpointError` naming the file and the rule broken:
a header length that is absurd or past the end of the file, JSON that is not an object
of tensor entries, unknown dtypes, negative or non-integer shapes, offsets whose length
disagrees with dtype x shape, holes, overlaps, and a data section whose size is not the
sum of its tensors. Never reads outside the file, never evaluates anything.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from incluster.errors import CorruptCheckpointError
from incluster.format.dtypes import ITEMSIZE

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_NAME_BYTES = 4096
MAX_DIMS = 64


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One validated tensor of a shard file: absolute offset into the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShardHeader:
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _fail(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: {why}; the shard is damaged or not an incluster/safetensors file - "
        f"restore from a replica or an older step, or delete it"
    )


def _int(value: object) -> bool:
    return type(value) is int


def parse_header(prefix: bytes, file_size: int, where: str = "shard") -> ShardHeader:
    """Validate the header at the start of a file of ``file_size`` bytes.

    ``prefix`` must hold at least the first 8 bytes and, once the length is known, the
    whole header (see :func:`header_length`).
    """
    n = header_length(prefix, file_size, where)
    if len(prefix) < 8 + n:
        raise _fail(where, "header is truncated")
    try:
        table = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(where, f"header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(table, dict):
        raise _fail(where, "header JSON is not an object")
    metadata = table.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _fail(where, "__metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = file_size - data_start
    tensors: dict[str, StoredTensor] = {}
    for name, info in table.items():
        tensors[name] = _entry(name, info, data_start, where)
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        rel = t.offset - data_start
        if rel != pos:
            kind = "a hole" if rel > pos else "overlapping tensors"
            raise _fail(where, f"{kind} at data byte {min(rel, pos)} (tensor {t.name!r})")
        pos += t.nbytes
    if pos != data_len:
        raise _fail(where, f"tensors cover {pos} data bytes but the file holds {data_len}")
    return ShardHeader(tensors=tensors, metadata=metadata, data_start=data_start, file_size=file_size)


def header_length(prefix: bytes, file_size: int, where: str = "shard") -> int:
    """The JSON header length from the 8-byte prefix, checked against caps and the file."""
    if file_size < 8 or len(prefix) < 8:
        raise _fail(where, f"file is {file_size} bytes, too short for a header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise _fail(where, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise _fail(where, f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def _entry(name: object, info: object, data_start: int, where: str) -> StoredTensor:
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME_BYTES or "\0" in name:
        raise _fail(where, f"invalid tensor name {name!r}")
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise _fail(where, f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise _fail(where, f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_int(d) and d >= 0 for d in shape):
        raise _fail(where, f"tensor {name!r}: shape must be a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_int(o) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise _fail(where, f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
    nbytes = ITEMSIZE[dtype]
    for d in shape:
        nbytes *= d
    if offsets[1] - offsets[0] != nbytes:
        raise _fail(
            where,
            f"tensor {name!r}: data_offsets span {offsets[1] - offsets[0]} bytes but "
            f"{dtype}{shape} needs {nbytes}",
        )
    return StoredTensor(name, dtype, tuple(shape), data_start + offsets[0], nbytes)
