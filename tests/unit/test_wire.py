"""The piece schedule and buffers of a transfer's data round (recovery/wire.py)."""

from __future__ import annotations

import torch

from incluster.recovery.wire import Wire, cut


def test_pieces_cover_every_segment_in_file_order_and_skip_empty_ones():
    table = [(100, 10), (110, 0), (110, 25), (135, 4)]
    pieces = cut(table, 8)
    assert pieces == [(0, 0, 8), (0, 8, 2), (2, 0, 8), (2, 8, 8), (2, 16, 8), (2, 24, 1), (3, 0, 4)]
    covered = [table[i][0] + s + k for i, s, n in pieces for k in range(n)]
    assert covered == list(range(100, 139))


def test_a_cpu_wire_receives_in_place_and_a_staged_one_reuses_two_rounds_of_buffers():
    dest = torch.zeros(64, dtype=torch.uint8)
    direct = Wire(torch.device("cpu"), piece=16, window=2)
    assert direct.incoming(0, 0, dest[:16], 16).data_ptr() == dest.data_ptr()
    src = torch.arange(16, dtype=torch.uint8)
    assert direct.outgoing(0, 0, 0, src) is src
    assert direct.allocated == 0

    staged = Wire(torch.device("cpu"), direct=False, piece=16, window=2)
    seen = set()
    for r in range(6):
        for k in range(2):
            buf = staged.incoming(r, k, dest[16 * k : 16 * k + 16], 16)
            assert buf.data_ptr() not in (dest.data_ptr(), dest.data_ptr() + 16)
            seen.add(buf.data_ptr())
            out = staged.outgoing(0, r, k, src)
            assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert len(seen) == 4  # 2 rounds x 2 pieces, reused whatever the number of rounds
    assert staged.allocated == 2 * (2 * 2 * 16)  # in and out
    assert staged.incoming(0, 0, None, 5).numel() == 5  # thrown-away bytes go to a buffer too
    staged.close()
    assert staged.allocated == 0
