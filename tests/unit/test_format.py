"""The shard format: valid safetensors, aligned, strictly validated, checksummed."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from incluster.errors import CorruptCheckpointError
from incluster.format.checksum import Checksum, compute, verify
from incluster.format.dtypes import DTYPE_TO_NAME
from incluster.format.layout import ALIGN, LayoutCache, TensorSpec, build_layout
from incluster.format.reader import MAX_HEADER_BYTES, parse_header
from incluster.staging.engine import make_views


def _shard(tensors: dict[str, torch.Tensor]) -> bytes:
    specs = tuple(TensorSpec(n, DTYPE_TO_NAME[t.dtype], tuple(t.shape)) for n, t in tensors.items())
    layout = build_layout(specs)
    buf = torch.zeros(layout.total_size, dtype=torch.uint8)
    buf[: len(layout.header)] = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
    for view, t in zip(make_views(buf, layout), tensors.values()):
        view.copy_(t)
    return bytes(buf.numpy())


MIXED = {
    "model/w": torch.randn(3, 5),
    "model/b16": torch.randn(7).to(torch.bfloat16),
    "optim/state/0/step": torch.tensor(3.0),
    "flags": torch.tensor([True, False, True]),
    "ids": torch.arange(5, dtype=torch.int64),
    "half": torch.randn(2, 3).half(),
    "empty": torch.empty(0, 4),
    "bytes": torch.arange(3, dtype=torch.uint8),
}


def test_shard_is_valid_safetensors_and_every_tensor_matches(tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(_shard(MIXED))
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(MIXED)
        for name, t in MIXED.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
        assert f.metadata()["incluster"] == "1"


def test_data_start_is_aligned_and_every_tensor_naturally_aligned():
    raw = _shard(MIXED)
    hdr = parse_header(raw, len(raw))
    assert hdr.data_start % ALIGN == 0
    for t in hdr.tensors.values():
        itemsize = {"F64": 8, "I64": 8, "F32": 4, "BF16": 2, "F16": 2, "BOOL": 1, "U8": 1}[t.dtype]
        assert t.offset % itemsize == 0, t.name


def test_layout_cache_reuses_structure_and_rebuilds_on_change():
    cache = LayoutCache()
    a = (TensorSpec("x", "F32", (4,)),)
    b = (TensorSpec("x", "F32", (5,)),)
    assert cache.get(a) is cache.get(a)
    assert cache.get(b).fingerprint != cache.get(a).fingerprint
    assert (cache.hits, cache.misses) == (2, 2)


def _with_header(table: dict, data: bytes) -> bytes:
    raw = json.dumps(table).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "table,data,why",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}, b"\0" * 16, "hole"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlapping"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12, "needs 8"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "begin <= end"),
        ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "file holds 12"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, b"\0" * 8, "exactly"),
        ({"__metadata__": {"k": 3}}, b"", "strings"),
    ],
)
def test_reader_rejects_malformed_headers(table, data, why):
    raw = _with_header(table, data)
    with pytest.raises(CorruptCheckpointError, match=why):
        parse_header(raw, len(raw))


def test_reader_rejects_oversized_and_runaway_header_lengths():
    raw = struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}"
    with pytest.raises(CorruptCheckpointError, match="cap"):
        parse_header(raw, len(raw))
    raw = struct.pack("<Q", 100) + b"{}"
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        parse_header(raw, len(raw))
    with pytest.raises(CorruptCheckpointError, match="too short"):
        parse_header(b"\1\2", 2)


GOOD = _shard({"a": torch.randn(4), "b": torch.arange(6, dtype=torch.int32), "c": torch.randn(2, 2).double()})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_headers_are_rejected_or_describe_a_consistent_file(data):
    """Any mutation of the header bytes: either a clear CorruptCheckpointError, or a
    header whose tensors tile the data section exactly (never an out-of-file offset)."""
    n = struct.unpack("<Q", GOOD[:8])[0]
    raw = bytearray(GOOD)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 8 + n - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        hdr = parse_header(bytes(raw), len(raw))
    except CorruptCheckpointError:
        return
    spans = sorted((t.offset, t.offset + t.nbytes) for t in hdr.tensors.values())
    pos = hdr.data_start
    for lo, hi in spans:
        assert lo == pos and hi <= len(raw)
        pos = hi
    assert pos == len(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_never_crash_the_reader(blob):
    try:
        parse_header(blob, len(blob))
    except CorruptCheckpointError:
        pass


def test_checksum_detects_any_single_bit_flip_and_truncation():
    data = bytearray(torch.randn(5000).numpy().tobytes())
    ck = compute(data, chunk=4096)
    assert len(ck.digests) == 5
    verify(data, ck, "x")
    for pos in (0, 4095, 4096, len(data) - 1):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        with pytest.raises(CorruptCheckpointError, match="mismatch"):
            verify(flipped, ck, "x")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        verify(data[:-1], ck, "x")


def test_checksum_record_round_trips_and_rejects_bad_records():
    ck = compute(b"hello world", chunk=4)
    assert Checksum.from_json(ck.to_json(), "x") == ck
    bad = ck.to_json() | {"digests": ["00"]}
    with pytest.raises(CorruptCheckpointError):
        Checksum.from_json(bad, "x")
    with pytest.raises(CorruptCheckpointError):
        Checksum.from_json(ck.to_json() | {"algo": "md5"}, "x")


def test_a_flipped_byte_in_a_state_tree_name_is_caught_by_the_sidecars_own_digest(tmp_path):
    """A name in the tree with one bit flipped still parses, and would load a state with a
    wrong key (an optimizer missing "exp_avg") behind valid shard checksums."""
    import json as _json

    from incluster.errors import CorruptCheckpointError
    from incluster.format.checksum import compute
    from incluster.format.sidecar import Sidecar, read_sidecar, write_sidecar

    tree = {"d": [["optim", {"d": [["exp_avg", {"v": 1}]]}]]}
    sc = Sidecar("job", 6, 3, 4, "D", "step-000000000006.safetensors", compute(b"x" * 64, 64), "fp", tree)
    path = str(tmp_path / "step-000000000006.json")
    write_sidecar(path, sc)
    assert read_sidecar(path).tree == tree
    raw = open(path, "rb").read()
    at = raw.index(b"exp_avg") + 4
    with open(path, "wb") as f:
        f.write(raw[:at] + bytes([raw[at] ^ 0x02]) + raw[at + 1 :])  # "exp_avg" -> "exp_cvg": still JSON
    _json.loads(open(path, "rb").read())
    with pytest.raises(CorruptCheckpointError, match="own digest"):
        read_sidecar(path)


def test_hash_threads_follow_the_cores_unless_the_environment_sets_them(monkeypatch):
    from incluster.format import checksum

    monkeypatch.delenv("INCLUSTER_HASH_THREADS", raising=False)
    monkeypatch.setattr(checksum, "core_share", lambda: 64)
    assert checksum.hash_threads() == 16
    monkeypatch.setattr(checksum, "core_share", lambda: 12)
    assert checksum.hash_threads() == 12
    monkeypatch.setattr(checksum, "core_share", lambda: 1)
    assert checksum.hash_threads() == 2
    monkeypatch.setenv("INCLUSTER_HASH_THREADS", "12")
    assert checksum.hash_threads() == 12
    for bad in ("0", "twelve", "-3", "1e3"):
        monkeypatch.setenv("INCLUSTER_HASH_THREADS", bad)
        with pytest.raises(ValueError, match="INCLUSTER_HASH_THREADS"):
            checksum.hash_threads()
