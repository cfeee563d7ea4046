"""The device side of a transfer's staged wire (what NCCL moves): a live tensor on the
GPU is received into directly, anything else through reused device buffers, and a GPU
piece is hashed from a page-locked host copy. (The NCCL exchange itself needs two GPUs.)

Runs only where CUDA is available (marker ``gpu``); CPU-only runs skip it.
"""

from __future__ import annotations

import pytest
import torch

from incluster.recovery.wire import Wire

pytestmark = pytest.mark.gpu


def test_gpu_wire_lands_live_gpu_tensors_in_place_and_stages_the_rest():
    dev = torch.device("cuda", torch.cuda.current_device())
    w = Wire(dev, direct=False, piece=1 << 20, window=2)
    live = torch.zeros(3 << 20, dtype=torch.uint8, device=dev)
    piece = live[1 << 20 : 2 << 20]
    assert w.incoming(1, 0, 0, 2 << 20, piece).data_ptr() == piece.data_ptr()
    host_dest = torch.zeros(1 << 20, dtype=torch.uint8)
    staged = w.incoming(1, 0, 1 << 20, 2 << 20, host_dest)
    assert staged.device == dev and staged.data_ptr() != host_dest.data_ptr()
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    out = w.outgoing(1, 0, 0, 2 << 20, src)
    assert out.device == dev and torch.equal(out.cpu(), src)
    piece.copy_(src.to(dev))
    host = w.host_view(piece)
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, src)
    strided = torch.arange(64, dtype=torch.float32, device=dev).reshape(8, 8)[:, 2:6]
    assert w.incoming(1, 1, 0, 128, strided).data_ptr() != strided.data_ptr()  # not contiguous: staged
    assert torch.equal(w.outgoing(1, 1, 0, 128, strided).view(torch.float32).view(8, 4), strided.contiguous())
    assert w.allocated <= 2 * 2 * (1 << 20) * 2 + (1 << 20)
    w.close()
    assert w.allocated == 0
