"""Bytes between ranks in bounded pieces: a restore's shard transfer and a reshard's moves.

Both ends cut every message (a tensor, or a strided view of one) into pieces of at most
``PIECE`` bytes (:func:`chunks`), and move them in rounds of at most ``WINDOW x PIECE``
bytes per peer (many small messages share a round), with two rounds in flight: round
r+1 is posted before round r's pieces are put in place and checked, so the link stays
busy while the receiver hashes. Nothing is ever held at the size of a shard:

- gloo moves CPU tensors: contiguous bytes go out as they are (a mapped file's) and a
  piece whose destination is contiguous CPU memory is received straight into it.
- NCCL moves GPU tensors: the sender copies each piece into a reused device buffer (one
  per peer and round parity, sized to the round); the receiver takes a piece whose
  destination is a contiguous live tensor on its GPU straight into that tensor, and any
  other piece into its own such buffer, then to its destination. At most
  ``2 x WINDOW x PIECE`` bytes of device memory per peer and direction (128 MiB with the
  defaults), and no more than the pieces staged so far needed, whatever the shard's size.

The same staged path runs with CPU buffers (``Wire(torch.device("cpu"), direct=False)``),
which is how it is tested where there is no GPU.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch

PIECE = 32 << 20  # bytes per message: large enough for NCCL to run the link at full speed
WINDOW = 2  # pieces per peer in one round


def chunks(t: torch.Tensor, piece: int) -> list[torch.Tensor]:
    """Views of ``t`` of at most ``piece`` bytes each (rows, or parts of a row), whose
    elements in order are ``t``'s in row-major order; both ends of a message cut alike
    from its shape and dtype alone. Empty tensors give none."""
    size = t.element_size()
    if t.numel() == 0:
        return []
    if t.dim() == 0 or t.numel() * size <= piece:
        return [t]
    if t.dim() == 1:
        per = max(1, piece // size)
        return [t[i : i + per] for i in range(0, t.shape[0], per)]
    row = t[0].numel() * size
    if row > piece:
        return [c for i in range(t.shape[0]) for c in chunks(t[i], piece)]
    per = piece // row
    return [t[i : i + per] for i in range(0, t.shape[0], per)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


class Wire:
    """Where pieces are sent from and received into, for one transfer."""

    def __init__(self, device: torch.device, *, direct: bool = True, piece: int | None = None,
                 window: int | None = None) -> None:
        self.device = device
        self.direct = direct  # CPU pieces go out and come in as they are (gloo)
        self.piece = piece or PIECE
        self.window = window or WINDOW
        self._arenas: dict[tuple[str, int, int], torch.Tensor] = {}
        self._host: torch.Tensor | None = None

    @property
    def budget(self) -> int:
        """Bytes of one round per peer: ``window`` pieces (or one piece, if larger)."""
        return self.window * self.piece

    @property
    def allocated(self) -> int:
        """Bytes of buffers this wire holds: per peer and direction at most two rounds'
        worth (``2 x window x piece``), and only what the pieces staged so far needed;
        plus one host piece once a piece on the device was hashed."""
        return sum(b.numel() for b in self._arenas.values()) + (self._host.numel() if self._host is not None else 0)

    def _room(self, role: str, peer: int, round_: int, at: int, n: int, total: int) -> torch.Tensor:
        """Bytes ``at:at+n`` of the reused buffer for this round's pieces to or from
        ``peer`` (rounds alternate between two buffers; ``total``: the round's size)."""
        key = (role, peer, round_ % 2)
        b = self._arenas.get(key)
        if b is None or b.numel() < total:
            b = self._arenas[key] = torch.empty(total, dtype=torch.uint8, device=self.device)
        return b[at : at + n]

    def outgoing(self, peer: int, round_: int, at: int, total: int, src: torch.Tensor) -> torch.Tensor:
        """The bytes to send for a piece of a round to ``peer``: ``src``'s own (CPU bytes on
        a CPU wire; a strided piece is made contiguous first, at most a piece) or their copy
        at ``at`` in the round's reused buffer on the wire's device."""
        if self.direct and self.device.type == "cpu" and src.device.type == "cpu":
            return as_bytes(src.contiguous())
        buf = self._room("out", peer, round_, at, src.numel() * src.element_size(), total)
        buf.view(src.dtype).view(src.shape).copy_(src)
        return buf

    def incoming(self, peer: int, round_: int, at: int, total: int, dest: torch.Tensor) -> torch.Tensor:
        """Where to receive a piece of a round from ``peer``: ``dest``'s own bytes when the
        wire can write there (CPU bytes on a CPU wire, a live tensor on the wire's GPU),
        else ``at`` in the round's reused buffer (a ``meta`` dest: thrown away)."""
        if (dest.device == self.device and dest.is_contiguous()
                and (self.direct or self.device.type != "cpu")):
            return as_bytes(dest)
        return self._room("in", peer, round_, at, dest.numel() * dest.element_size(), total)

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
        self._arenas.clear()
        self._host = None


def for_backend(nccl: bool) -> Wire:
    """The wire for the default group's backend (NCCL: the current CUDA device). Callers
    look it up on this module, so a test can route every move through the staged path
    (:func:`incluster.testing.wire.route_through_staged_wire`)."""
    if nccl:
        from incluster.recovery.gather import nccl_device

        return Wire(nccl_device(), direct=False)
    return Wire(torch.device("cpu"))


ALIGN = 16  # pieces sit at multiples of this in a round's buffer, so any dtype can view them


def rounds_of(sizes: list[int], budget: int) -> list[tuple[int, int, list[int], int]]:
    """Pieces of these sizes (in bytes, in order) grouped into rounds of at most ``budget``
    bytes (a larger piece alone): ``(first, end, offsets, bytes)`` per round, offsets
    aligned to ``ALIGN``. Both ends of a pair group alike, from the sizes alone."""
    out: list[tuple[int, int, list[int], int]] = []
    offsets: list[int] = []
    first = at = 0
    for k, n in enumerate(sizes):
        room = -(-n // ALIGN) * ALIGN
        if offsets and at + room > budget:
            out.append((first, k, offsets, at))
            first, offsets, at = k, [], 0
        offsets.append(at)
        at += room
    if offsets:
        out.append((first, len(sizes), offsets, at))
    return out


Landed = Callable[[int, int, torch.Tensor], None]  # (message, byte offset in it, the piece in place)


def move(wire: Wire, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor, Landed | None]]) -> None:
    """Send every ``(peer, tensor)`` and receive every ``(peer, dest, landed)`` over the
    default group, cut into pieces (:func:`chunks`) and grouped, per peer, into rounds of
    at most ``wire.budget`` bytes (:func:`rounds_of`; many small messages share a round),
    two rounds in flight: round r+1 is on the wire while round r's pieces are put in place
    and checked. Messages between two ranks pair up in list order, so each side lists them
    in the same order. ``landed`` runs for each piece of its message in order, once the
    piece is in ``dest`` (a ``meta`` dest is received and thrown away). An error putting a
    piece in place is raised only once every round has run, so no peer is left waiting."""
    import torch.distributed as dist

    outs: dict[int, list[torch.Tensor]] = {}
    for peer, t in sends:
        outs.setdefault(peer, []).extend(chunks(t, wire.piece))
    ins: dict[int, list[tuple[int, int, torch.Tensor, Landed | None]]] = {}
    for m, (peer, dest, landed) in enumerate(recvs):
        at = 0
        for c in chunks(dest, wire.piece):
            ins.setdefault(peer, []).append((m, at, c, landed))
            at += c.numel() * c.element_size()

    def plan(pieces: list[Any], size: Any) -> list[tuple[int, int, list[int], int]]:
        return rounds_of([size(p) for p in pieces], wire.budget)

    out_rounds = {p: plan(x, lambda t: t.numel() * t.element_size()) for p, x in outs.items()}
    in_rounds = {p: plan(x, lambda e: e[2].numel() * e[2].element_size()) for p, x in ins.items()}
    rounds = max([len(x) for x in [*out_rounds.values(), *in_rounds.values()]], default=0)
    error: list[BaseException] = []

    def post(r: int) -> tuple[list[Any], int, list[tuple[Any, ...]]]:
        ops, landing = [], []
        for peer in sorted(ins):
            if r < len(in_rounds[peer]):
                first, end, offsets, total = in_rounds[peer][r]
                for (m, at, dest, landed), off in zip(ins[peer][first:end], offsets):
                    buf = wire.incoming(peer, r, off, total, dest)
                    ops.append(dist.P2POp(dist.irecv, buf, peer))
                    landing.append((m, at, dest, landed, buf))
        for peer in sorted(outs):
            if r < len(out_rounds[peer]):
                first, end, offsets, total = out_rounds[peer][r]
                for src, off in zip(outs[peer][first:end], offsets):
                    ops.append(dist.P2POp(dist.isend, wire.outgoing(peer, r, off, total, src), peer))
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        return works, len(ops), landing

    def settle(works: list[Any], nops: int, landing: list[tuple[Any, ...]]) -> None:
        nrecv = len(landing)
        if len(works) != nops:  # one work for the whole batch: wait for all of it first
            for x in works:
                x.wait()
            works = [None] * nrecv
        for x, (m, at, dest, landed, buf) in zip(works[:nrecv], landing):
            if x is not None:
                x.wait()  # pieces are put in place and checked in order, each once it is in
            if dest.device.type == "meta" or error:
                continue
            try:
                if buf.data_ptr() != dest.data_ptr() or buf.device != dest.device:
                    dest.copy_(buf.view(dest.dtype).view(dest.shape))
                if landed is not None:
                    landed(m, at, dest)
            except Exception as exc:  # noqa: BLE001 - raised after the last round
                error.append(exc)
        for x in works[nrecv:]:
            x.wait()

    flight: deque[Any] = deque()
    for r in range(rounds):
        flight.append(post(r))
        if len(flight) == 2:
            settle(*flight.popleft())
    while flight:
        settle(*flight.popleft())
    if error:
        raise error[0]
