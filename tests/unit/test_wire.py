"""Pieces, rounds and buffers of the bounded wire (recovery/wire.py)."""

from __future__ import annotations

import torch

from incluster.recovery.wire import ALIGN, Wire, chunks, rounds_of


def _join(parts):
    return torch.cat([p.reshape(-1) for p in parts])


def test_pieces_are_views_in_element_order_and_never_larger_than_a_piece():
    flat = torch.arange(1000, dtype=torch.uint8)
    parts = chunks(flat, 64)
    assert [p.numel() for p in parts] == [64] * 15 + [40]
    assert all(p.data_ptr() == flat.data_ptr() + 64 * i for i, p in enumerate(parts))  # views, no copies
    wide = torch.arange(6 * 100, dtype=torch.float32).reshape(6, 100)  # a row (400 B) is over a piece
    strided = wide[:, 10:90]  # not contiguous, like a Shard(1) box
    for t in (wide, strided, torch.arange(300, dtype=torch.int64).reshape(3, 10, 10)):
        parts = chunks(t, 128)
        assert all(p.numel() * p.element_size() <= 128 for p in parts)
        assert torch.equal(_join(parts), t.reshape(-1))
    assert chunks(torch.empty(0, 5), 8) == []
    assert len(chunks(torch.tensor(3.0), 1)) == 1


def test_rounds_are_bounded_in_bytes_and_small_messages_share_one():
    assert rounds_of([8] * 100, 64 * ALIGN)[0][:2] == (0, 64)  # 64 scalars (aligned) in one round
    rounds = rounds_of([100, 30, 100, 1, 1, 300, 5], 256)
    assert [(a, b) for a, b, _, _ in rounds] == [(0, 3), (3, 5), (5, 6), (6, 7)]  # 112 + 32 + 112 bytes
    for a, b, offsets, total in rounds:
        assert all(o % ALIGN == 0 for o in offsets) and (total <= 256 or b - a == 1)
    assert rounds_of([], 64) == []


def test_a_cpu_wire_receives_in_place_and_a_staged_one_reuses_two_rounds_of_buffers():
    dest = torch.zeros(64, dtype=torch.uint8)
    direct = Wire(torch.device("cpu"), piece=16, window=2)
    assert direct.incoming(1, 0, 0, 32, dest[:16]).data_ptr() == dest.data_ptr()
    src = torch.arange(16, dtype=torch.uint8)
    assert direct.outgoing(1, 0, 0, 32, src).data_ptr() == src.data_ptr()
    assert direct.allocated == 0
    strided = torch.arange(32, dtype=torch.uint8).reshape(4, 8)[:, :4]
    assert torch.equal(direct.outgoing(1, 0, 0, 32, strided), strided.reshape(-1))  # made contiguous

    staged = Wire(torch.device("cpu"), direct=False, piece=16, window=2)
    seen = set()
    for r in range(6):
        for k in range(2):
            buf = staged.incoming(1, r, 16 * k, 32, dest[16 * k : 16 * k + 16])
            assert buf.data_ptr() not in (dest.data_ptr(), dest.data_ptr() + 16)
            seen.add(buf.data_ptr())
            out = staged.outgoing(1, r, 16 * k, 32, src)
            assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert len(seen) == 4  # 2 rounds x 2 pieces, reused whatever the number of rounds
    assert staged.allocated == 2 * (2 * 32)  # in and out, two rounds each
    small = Wire(torch.device("cpu"), direct=False, piece=1 << 20, window=2)
    small.outgoing(1, 0, 0, 16, torch.tensor([1.0]))
    assert small.allocated == 16  # sized to the round, not to a piece
    typed = torch.arange(4, dtype=torch.float32)
    assert torch.equal(staged.outgoing(1, 0, 0, 32, typed).view(torch.float32), typed)
    assert staged.incoming(1, 0, 0, 32, torch.empty(5, dtype=torch.uint8, device="meta")).numel() == 5
    staged.close()
    assert staged.allocated == 0
