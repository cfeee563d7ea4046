"""Hashing a slot while copies still land in it: each chunk only once every byte below
its end is in, and the digests those of the finished buffer (the CPU half of the direct
GPU path, with events that land their copies when waited on)."""

from __future__ import annotations

import random

import pytest
import torch

from incluster.format.checksum import Frontier, compute
from incluster.staging.engine import hash_behind, landed_below


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 64 * 5 + 3])
def test_frontier_hashes_only_whole_landed_chunks_and_matches_a_full_pass(size):
    buf = bytearray(random.Random(size).randbytes(size))
    front = Frontier(buf, size, 64)
    upto, rng = 0, random.Random(1)
    while upto < size:
        upto = min(size, upto + rng.randint(1, 100))
        front.advance(upto)
        ends = [min(size, (k + 1) * 64) for k in range(len(front.futures))]
        assert all(e <= upto for e in ends)  # nothing hashed past what has landed
        assert len(front.futures) == sum(1 for k in range(-(-size // 64)) if min(size, (k + 1) * 64) <= upto)
    assert front.digests() == compute(bytes(buf), size, 64).digests


class LandsWhenWaited:
    """A stand-in for a CUDA event: waiting on it lands the copies before it."""

    def __init__(self, copies, upto, landed):
        self.copies, self.upto, self.landed = copies, upto, landed

    def synchronize(self):
        for j, (dst, src) in enumerate(self.copies[: self.upto + 1]):
            dst.copy_(src)
            self.landed.add(j)


class Checked(Frontier):
    """Records, per advance, whether any byte below ``upto`` still had a copy on its way."""

    def __init__(self, buf, size, chunk, spans, landed):
        super().__init__(buf, size, chunk)
        self.spans, self.landed, self.early = spans, landed, []

    def advance(self, upto):
        self.early += [(a, b) for j, (a, b) in enumerate(self.spans) if j not in self.landed and a < upto]
        super().advance(upto)


def _run(spans, size, starts=None):
    slot = torch.zeros(size, dtype=torch.uint8)
    slot[: spans[0][0]] = 7  # the header
    g = torch.Generator().manual_seed(0)
    dsts = [slot[a:b] for a, b in spans]
    srcs = [torch.randint(0, 255, (b - a,), dtype=torch.uint8, generator=g) for a, b in spans]
    expected = slot.clone()
    for (a, b), src in zip(spans, srcs):
        expected[a:b] = src
    landed: set[int] = set()
    copies = list(zip(dsts, srcs))
    marks = [(i, LandsWhenWaited(copies, i, landed)) for i in range(len(copies))]
    front = Checked(slot.numpy(), size, 64, spans, landed)
    hash_behind(front, marks, landed_below(slot, dsts, size) if starts is None else starts)
    return front, compute(expected.numpy(), size, 64).digests


def test_hash_behind_hashes_no_byte_before_its_copy_and_matches_the_finished_slot():
    # GPU copies out of file order, a CPU tensor's bytes (already in place) between them
    spans = [(100, 700), (1400, 2000), (700, 1000), (2100, 2500)]
    slot = torch.zeros(2500, dtype=torch.uint8)
    assert landed_below(slot, [slot[a:b] for a, b in spans], 2500) == [700, 700, 2100, 2500]
    front, digests = _run(spans, 2500)
    assert front.early == []
    assert front.digests() == digests


def test_a_frontier_that_runs_ahead_is_seen():
    """The check above can fail: a frontier claiming every byte after the first copy."""
    front, _ = _run([(64, 512), (512, 1024)], 1024, starts=[1024, 1024])
    assert front.early == [(512, 1024)]
