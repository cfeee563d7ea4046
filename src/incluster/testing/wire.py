"""Test support: route a module's transfers through the staged wire NCCL uses, with CPU
buffers, so a CPU-only run exercises the bounded pieces (see
:mod:`incluster.recovery.wire`)."""

from __future__ import annotations

from typing import Any

import torch


def route_through_staged_wire(module: Any, piece: int, window: int = 2) -> list[int]:
    """Replace ``module.make_wire`` (``incluster.recovery.transfer`` or ``.reshard``) with
    a staged CPU wire of ``piece``-byte pieces; returns a one-item list that holds the most
    buffer bytes any one transfer held, updated as transfers end."""
    from incluster.recovery.wire import Wire

    peak = [0]

    class Tracked(Wire):
        def close(self) -> None:
            peak[0] = max(peak[0], self.allocated)
            super().close()

    module.make_wire = lambda nccl: Tracked(torch.device("cpu"), direct=False, piece=piece, window=window)
    return peak
