"""A shard's data segments on the wire in bounded pieces (the third round of a transfer).

Both ends cut every segment into pieces of at most ``PIECE`` bytes, in file order, and
move them in rounds of ``WINDOW`` pieces per peer, with two rounds in flight: round r+1
is posted before round r's pieces are checked, so the link stays busy while the receiver
hashes. Nothing is ever held at the size of the shard:

- gloo moves CPU tensors: the sender's mapped file goes out as it is and every piece is
  received straight into its destination (the live tensor or scratch memory) - no copy.
- NCCL moves GPU tensors: the sender copies each piece of its file into one of
  ``2 x WINDOW`` reused device buffers; the receiver takes a piece whose destination is a
  live tensor on its GPU straight into that tensor, and any other piece into one of its own
  ``2 x WINDOW`` device buffers, then to its (host) destination. At most
  ``4 x WINDOW x PIECE`` bytes of device memory per peer, whatever the shard's size.

The same staged path runs with CPU buffers (``Wire(torch.device("cpu"), direct=False)``),
which is how it is tested where there is no GPU.
"""

from __future__ import annotations

from typing import Any

import torch

PIECE = 32 << 20  # bytes per message: large enough for NCCL to run the link at full speed
WINDOW = 2  # pieces per peer in one round


def cut(table: list[tuple[int, int]], piece: int) -> list[tuple[int, int, int]]:
    """``(segment index, start in the segment, length)`` for every piece of the segments
    ``table`` lists as ``(file offset, length)``, in file order; empty segments have none."""
    out = []
    for i, (_, n) in enumerate(table):
        for start in range(0, n, piece):
            out.append((i, start, min(piece, n - start)))
    return out


class Wire:
    """Where pieces are sent from and received into, for one transfer."""

    def __init__(self, device: torch.device, *, direct: bool = True, piece: int | None = None,
                 window: int | None = None) -> None:
        self.device = device
        self.direct = direct  # CPU pieces go out and come in as they are (gloo)
        self.piece = piece or PIECE
        self.window = window or WINDOW
        self._bufs: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self._host: torch.Tensor | None = None

    @property
    def allocated(self) -> int:
        """Bytes of buffers this wire holds (its bound: ``2 x window x piece`` per peer and
        direction, plus one host piece when live tensors on the device are received into)."""
        return sum(b.numel() for b in self._bufs.values()) + (self._host.numel() if self._host is not None else 0)

    def _buf(self, role: str, peer: int, round_: int, k: int, n: int) -> torch.Tensor:
        key = (role, peer, round_ % 2, k)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = torch.empty(self.piece, dtype=torch.uint8, device=self.device)
        return b[:n]

    def outgoing(self, peer: int, round_: int, k: int, src: torch.Tensor) -> torch.Tensor:
        """What to send for piece ``k`` of a round to ``peer``: ``src`` itself (CPU bytes on
        a CPU wire) or its copy in a reused buffer on the wire's device."""
        if self.direct and self.device.type == "cpu":
            return src
        buf = self._buf("out", peer, round_, k, src.numel())
        buf.copy_(src)
        return buf

    def incoming(self, round_: int, k: int, dest: torch.Tensor | None, n: int) -> torch.Tensor:
        """Where to receive piece ``k`` of a round: its destination itself when the wire can
        write there, else a reused buffer (``dest`` None: the bytes are thrown away)."""
        if dest is not None and dest.device == self.device and (self.direct or self.device.type != "cpu"):
            return dest  # CPU bytes on a CPU wire, or a live tensor on the wire's GPU
        return self._buf("in", 0, round_, k, n)

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s bytes in host memory, to hash: ``t`` itself on the CPU, else a copy in one
        reused (page-locked) host buffer, valid until the next call."""
        if t.device.type == "cpu":
            return t
        if self._host is None:
            self._host = torch.empty(self.piece, dtype=torch.uint8, pin_memory=t.device.type == "cuda")
        host = self._host[: t.numel()]
        host.copy_(t)  # waits for the copy: the bytes are hashed right after
        return host

    def close(self) -> None:
        self._bufs.clear()
        self._host = None


def for_backend(nccl: bool) -> Wire:
    """The wire for the default group's backend (NCCL: the current CUDA device)."""
    if nccl:
        return Wire(torch.device("cuda", torch.cuda.current_device()), direct=False)
    return Wire(torch.device("cpu"))


def post(ops: list[Any]) -> list[Any]:
    import torch.distributed as dist

    return list(dist.batch_isend_irecv(ops)) if ops else []
