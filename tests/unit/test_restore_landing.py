"""The fused restore: bytes land in the live tensors and are checked chunk by chunk as
they land; a bad chunk never leaves a torn state behind."""

from __future__ import annotations

import os
import random

import pytest
import torch

import incluster
from incluster.errors import CorruptCheckpointError, NoCheckpointError
from incluster.format.checksum import ChunkVerifier, compute
from incluster.format.reader import parse_header
from incluster.recovery.gather import gather_to_zero
from incluster.recovery.landing import Landing, direct_targets, read_verified, segments
from incluster.staging.slots import step_file
from incluster.state_load import live_targets, load_into

from helpers import shard_bytes, tiny_model, train


def _pieces(data: bytes, rng: random.Random) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, 2500)
        out.append(data[i : i + n])
        i += n
    return out


def test_chunk_verifier_accepts_any_cut_and_names_the_bad_chunk():
    rng = random.Random(1)
    data = bytes(rng.getrandbits(8) for _ in range(10_500))
    ck = compute(data, chunk=1000)
    v = ChunkVerifier(ck, "x")
    for p in _pieces(data, rng):
        v.update(p)
    v.finish()
    bad = bytearray(data)
    bad[4321] ^= 1
    v = ChunkVerifier(ck, "x")
    with pytest.raises(CorruptCheckpointError, match="bytes 4000..5000"):
        for p in _pieces(bytes(bad), rng):
            v.update(p)
    v = ChunkVerifier(ck, "x")
    v.update(data[:-1])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        v.finish()
    v = ChunkVerifier(ck, "x", first=3)  # a chunk on its own (parallel readers)
    v.update(data[3000:4000])
    v.finish(4000)


def test_segments_cover_the_file_in_order():
    data, _ = shard_bytes({"a": torch.randn(100_000), "b": torch.ones(3), "c": torch.zeros(2), "d": torch.randn(70_000)})
    header = parse_header(data, len(data))
    for big in (1, 256 * 1024):
        segs = segments(header, big)
        assert segs[0].offset == 0 and segs[0].nbytes == header.data_start
        pos = 0
        for s in segs:
            assert s.offset == pos and s.nbytes > 0
            pos += s.nbytes
        assert pos == len(data)
        assert [s.name for s in segs if s.name] == (["a", "b", "c", "d"] if big == 1 else ["a", "d"])


def test_direct_targets_skip_what_cannot_take_raw_bytes():
    base = torch.zeros(200)
    live = {
        "plain": torch.zeros(100),
        "strided": torch.zeros(100, 2)[:, 0],
        "ov1": base[:150],
        "ov2": base[100:],
    }
    saved = {k: torch.ones(v.shape) for k, v in live.items()}
    data, flat = shard_bytes(saved)
    header = parse_header(data, len(data))
    targets = direct_targets(live, flat.tree, header, allow_pickle=False, big=1)
    assert set(targets) == {"plain"}


def test_a_live_tensor_of_another_dtype_or_shape_is_refused_before_anything_lands():
    """load() would refuse it after the other tensors had landed: refused first, so the
    live state is untouched (a reshard, whose shards change shape, passes strict=False)."""
    from incluster.errors import CheckpointError

    saved = {"a": torch.ones(100), "b": torch.ones(100)}
    data, flat = shard_bytes(saved)
    header = parse_header(data, len(data))
    for live, says in (({"a": torch.zeros(100), "b": torch.zeros(100, dtype=torch.float64)}, "torch.float64"),
                       ({"a": torch.zeros(100), "b": torch.zeros(50)}, r"shape \(100,\)")):
        with pytest.raises(CheckpointError, match=says):
            direct_targets(live, flat.tree, header, allow_pickle=False, big=1)
        assert set(direct_targets(live, flat.tree, header, allow_pickle=False, big=1, strict=False)) == {"a"}


def test_placed_tensors_are_not_copied_again_and_the_rest_is_fetched(tmp_path):
    m = tiny_model(0)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, o, 2)
    state = {"model": m, "optim": o, "extra": {"n": 7}}
    data, flat = shard_bytes(state)
    path = tmp_path / "shard"
    path.write_bytes(data)
    m2 = tiny_model(3)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)  # not stepped: state is created first
    live = {"model": m2, "optim": o2, "extra": {}}
    header = parse_header(data, len(data))
    targets = direct_targets(live, flat.tree, header, allow_pickle=False, big=1)
    assert any(n.startswith("model") for n in targets) and set(targets) <= set(live_targets(live, flat.tree))
    landing = Landing(header, segments(header, big=1), targets)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_verified(fd, landing, compute(data, chunk=4096), str(path), workers=2)
    finally:
        os.close(fd)
    ptrs = [p.data_ptr() for p in m2.parameters()]
    load_into(live, flat.tree, landing.fetch, placed=landing.placed)
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(o.state.values(), o2.state.values()):
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
    assert live["extra"] == {"n": 7}


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_bad_chunk_found_mid_load_is_overwritten_by_the_older_step(local_dir):
    w1, w2 = torch.full((50_000,), 1.0), torch.full((50_000,), 2.0)
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        ck.save(1, {"w": w1, "v": w1[:10].clone()}).wait()
        ck.save(2, {"w": w2, "v": w2[:10].clone()}).wait()
        folder = ck.folder
    path = os.path.join(folder, step_file(2))
    _flip(path, os.path.getsize(path) - 5)  # in the last tensor: "w" has landed already
    target = {"w": torch.zeros(50_000), "v": torch.zeros(10)}
    ptr = target["w"].data_ptr()
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        assert ck.load(target) == 1
        assert any("checksum mismatch" in n for n in ck.last_restore.notes)
    assert torch.equal(target["w"], w1) and torch.equal(target["v"], w1[:10]) and target["w"].data_ptr() == ptr


def test_no_good_copy_after_a_partial_load_says_the_state_was_overwritten(local_dir):
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        ck.save(1, {"w": torch.ones(50_000), "v": torch.ones(10)}).wait()
        folder = ck.folder
    path = os.path.join(folder, step_file(1))
    _flip(path, os.path.getsize(path) - 5)
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        with pytest.raises(incluster.CheckpointError, match="partly overwritten") as err:
            ck.load({"w": torch.zeros(50_000), "v": torch.zeros(10)})
        assert not isinstance(err.value, NoCheckpointError)  # callers that start afresh on it must not


def test_every_copy_of_a_rank_bad_is_said_as_such_not_as_lost():
    """Every copy of rank 0's steps 25 and 30 failed its check, rank 1's are good: the
    error said step 30 "lacks rank(s) [0]" and offered a persistent tier, as if a node
    were lost, not that the copies were bad."""
    from types import SimpleNamespace

    from incluster.recovery.plan_round import plan_round

    ctx = SimpleNamespace(local_dir="/ram", job="t", persistent=None, world_size=2, rank=0, only_step=None)
    inv = [(o, s, 100, 2, 0) for o in (0, 1) for s in (25, 30)]
    said = plan_round(ctx, [("n0", inv), ("n1", [])], {("n0", 0, 25), ("n0", 0, 30)})
    assert isinstance(said, str)
    assert said.startswith("no step has a good copy of every rank's shard: copies of step(s) [25, 30] failed "
                           "verification"), said
    assert "step 30 now lacks rank(s) [0]" in said and "name a new job (job=...)" in said


def test_gather_to_zero_alone():
    assert gather_to_zero({"a": 1}, 0, 1) == [{"a": 1}]


@pytest.mark.parametrize("corrupt", [False, True])
def test_bounce_pipeline_lands_bitwise_and_finds_a_bad_byte(tmp_path, monkeypatch, corrupt):
    """The GPU restore's read -> hash -> copy pipeline, run with CPU destinations: small
    bounce buffers (many round trips through the pool), several readers, bitwise or a
    named bad chunk."""
    import incluster.recovery.device_landing as dl

    monkeypatch.setattr(dl, "BOUNCE", 3000)
    monkeypatch.setattr(dl, "_pools", {})
    saved = {"a": torch.randn(50_000), "b": torch.randn(7), "c": torch.randn(30_001)}
    data, flat = shard_bytes(saved)
    if corrupt:
        data = bytearray(data)
        data[-5000] ^= 0x40
        data = bytes(data)
        expected = compute(shard_bytes(saved)[0], chunk=8192)
    else:
        expected = compute(data, chunk=8192)
    path = tmp_path / "shard"
    path.write_bytes(data)
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    header = parse_header(data, len(data))
    targets = direct_targets(live, flat.tree, header, allow_pickle=False, big=1)
    landing = Landing(header, segments(header, big=1), targets)
    fd = os.open(path, os.O_RDONLY)
    try:
        if corrupt:
            with pytest.raises(CorruptCheckpointError):
                read_verified(fd, landing, expected, str(path), workers=3, bounce_cpu=True)
        else:
            read_verified(fd, landing, expected, str(path), workers=3, bounce_cpu=True)
    finally:
        os.close(fd)
    (pool,) = dl._pools.values()
    # bounded (two per reader, made as needed), and a failed read loses none of them:
    # a pool short of buffers would hang the process's next restore
    assert pool.size == 3000 and 1 <= len(pool.bufs) <= 6
    assert pool._free.qsize() == len(pool.bufs)
    if corrupt:
        return
    load_into(live, flat.tree, landing.fetch, placed=landing.placed)
    for k, v in saved.items():
        assert torch.equal(live[k], v), k


def test_bounce_pool_grows_only_as_readers_need_buffers(tmp_path, monkeypatch):
    """Page-locked memory is slow to allocate, so a restore must not make its whole pool
    up front: one reader cycling through a shard of many buffers' worth reuses one buffer;
    a later restore in the process reuses the pool."""
    import incluster.recovery.device_landing as dl

    monkeypatch.setattr(dl, "BOUNCE", 4096)
    monkeypatch.setattr(dl, "_pools", {})
    saved = {"a": torch.randn(40_000), "b": torch.randn(9_000)}
    data, flat = shard_bytes(saved)
    expected = compute(data, chunk=1 << 16)
    path = tmp_path / "shard"
    path.write_bytes(data)
    for _ in range(2):
        live = {k: torch.zeros_like(v) for k, v in saved.items()}
        header = parse_header(data, len(data))
        landing = Landing(header, segments(header, big=1), direct_targets(live, flat.tree, header,
                                                                          allow_pickle=False, big=1))
        fd = os.open(path, os.O_RDONLY)
        try:
            read_verified(fd, landing, expected, str(path), workers=1, bounce_cpu=True)
        finally:
            os.close(fd)
        load_into(live, flat.tree, landing.fetch, placed=landing.placed)
        assert all(torch.equal(live[k], v) for k, v in saved.items())
        (pool,) = dl._pools.values()
        assert len(data) > 40 * pool.size and pool.count == 2 and len(pool.bufs) == 1


def test_rank_lists_are_said_as_ranges():
    from incluster.recovery.meet import ranges

    assert ranges([1]) == "1"
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
