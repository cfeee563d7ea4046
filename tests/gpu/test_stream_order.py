"""Work the trainer queued on the compute stream before incluster touches the GPU runs
first: a restore's copies into the live tensors, and the snapshot buffer's zero-fill,
happen on other streams and must wait for it. Each test queues a ~0.2 s sleep and then a
write on the compute stream, so an unordered copy lands before that write and is
overwritten (or overwrites), unseen by any checksum.

Runs only where CUDA is available (marker ``gpu``); CPU-only runs skip it.
"""

from __future__ import annotations

import os

import pytest
import torch

from incluster.format.checksum import compute
from incluster.format.layout import build_layout
from incluster.format.reader import parse_header
from incluster.recovery.landing import Landing, direct_targets, read_verified, segments
from incluster.staging import device_snapshot
from incluster.state import flatten

from helpers import shard_bytes

pytestmark = pytest.mark.gpu
DELAY = int(4e8)  # GPU clock cycles (~0.2 s)


def test_a_restore_lands_after_work_queued_before_it(tmp_path):
    """A new optimizer's first step (how a fresh process makes the state it restores
    into) is queued on the compute stream just before the restore: its writes must not
    land after the restored bytes."""
    saved = {"a": torch.randn(3_000_000), "b": torch.randn(1000)}
    data, flat = shard_bytes(saved)
    path = tmp_path / "shard"
    path.write_bytes(data)
    live = {k: torch.zeros_like(v, device="cuda") for k, v in saved.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(DELAY)
    for v in live.values():
        v.fill_(7.0)  # queued behind the sleep, before the restore
    header = parse_header(data, len(data))
    targets = direct_targets(live, flat.tree, header, allow_pickle=False, big=1, devices=("cpu", "cuda"))
    assert set(targets) == set(saved)
    landing = Landing(header, segments(header, big=1), targets)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_verified(fd, landing, compute(data, chunk=1 << 20), str(path), workers=2)
    finally:
        os.close(fd)
    torch.cuda.synchronize()
    for k, v in saved.items():
        assert torch.equal(live[k].cpu(), v), k


def test_the_snapshot_buffer_is_filled_before_a_copy_into_it():
    """The buffer is made (zero-filled) on the staging thread's current stream, behind the
    training work queued there; the snapshot's copies run on a side stream and must not
    land before the fill."""
    snaps = device_snapshot.DeviceSnapshots(64 << 20)
    src = [torch.randn(1 << 20, device="cuda"), torch.randn(4096, device="cuda")]
    flat = flatten({"x": src[0], "y": src[1]})
    layout = build_layout(flat.specs)
    torch.cuda.synchronize()
    torch.cuda._sleep(DELAY)  # training work still queued when the first save makes the buffer
    plan = snaps.plan(layout, flat.tensors, ["g", "g"])
    assert plan is not None
    stream = torch.cuda.Stream()
    start = torch.cuda.Event()
    start.record(stream)  # a start the copies need not wait for: only the fill orders them
    done = device_snapshot.snap(plan, flat.tensors, stream, start)
    done.synchronize()
    torch.cuda.synchronize()
    for view, t in zip(plan.views, flat.tensors):
        assert torch.equal(view, t)
