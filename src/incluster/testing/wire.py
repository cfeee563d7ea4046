"""Test support: route a module's transfers through the staged wire NCCL uses, with CPU
buffers, so a CPU-only run exercises the bounded pieces (see
:mod:`incluster.recovery.wire`)."""

from __future__ import annotations

import torch


def route_through_staged_wire(piece: int, window: int = 2) -> list[int]:
    """Make every restore transfer and reshard move in this process use a staged CPU wire
    of ``piece``-byte pieces; returns a one-item list that holds the most buffer bytes any
    one transfer held, updated as transfers end."""
    from incluster.recovery import wire
    from incluster.recovery.wire import Wire

    peak = [0]

    class Tracked(Wire):
        def close(self) -> None:
            peak[0] = max(peak[0], self.allocated)
            super().close()

    wire.for_backend = lambda nccl: Tracked(torch.device("cpu"), direct=False, piece=piece, window=window)
    return peak
