"""Moving shards between ranks during a restore, over the job's default process group.

Three rounds with ``batch_isend_irecv``, so every rank's sends and receives run
together: (1) sizes; (2) the sidecar, the shard's header and the segment table
(:mod:`incluster.recovery.landing`), each posted at once; (3) the data segments, in
bounded pieces (:func:`incluster.recovery.wire.move`). The receiver lands
each segment straight in the live tensor it belongs to (or in scratch memory) and hashes
it as soon as it is in; the caller loads into the state only when every chunk matched,
and restores from another copy when one did not.

Healing the receiver's node (writing what it received into one of its own slot files,
with plain writes, and committing it) is :meth:`Received.heal`: the Checkpointer runs it
in the background behind the optimizer pre-step hook, as it does a save's copy, so a
restore returns as soon as the state is verified and in place.

The data moves in bounded pieces (:mod:`incluster.recovery.wire`): gloo moves CPU
tensors, the sender's mapped file going out as it is; NCCL moves GPU tensors through a few
reused device buffers, and a live tensor on the receiver's GPU takes its pieces directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.format.checksum import ChunkVerifier
from incluster.format.reader import parse_header
from incluster.format.sidecar import Sidecar
from incluster.recovery.gather import device_for_collectives
from incluster.recovery.landing import PIECE, Landing, direct_targets, segments
from incluster.recovery import wire as wires
from incluster.recovery.wire import Wire, move
from incluster.staging.slots import SlotRing
from incluster.tiers.local import ShardReader
from incluster.writer.local_commit import commit_received, parse_received_sidecar

_MAX_SIDECAR = 256 * 1024 * 1024
log = logging.getLogger("incluster")


@dataclass
class Outgoing:
    dst: int
    sidecar: bytes
    reader: ShardReader  # header validated, mapped; the receiver checks every byte


@dataclass
class Incoming:
    """What the receiving side needs: where the bytes go and how to check them."""

    source: int
    state: Mapping[str, Any]
    allow_pickle: bool
    world_size: int


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(device_for_collectives())


def _empty(n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device=device_for_collectives())


def _wait(ops: list[Any]) -> list[Any]:
    return list(dist.batch_isend_irecv(ops)) if ops else []


def exchange(
    rank: int,
    step: int,
    incoming: Incoming | None,
    outgoing: list[Outgoing],
    ring: SlotRing,
    *,
    job: str,
    node: str,
    timeout_s: float,
) -> tuple[str | None, "Received | None"]:
    """Send ``outgoing`` and, with ``incoming``, receive this rank's shard.

    Returns (why the received copy is unusable, or None; and on success the verified
    copy: its sidecar and landing to finish the load from, and its heal still to run)."""
    src = incoming.source if incoming is not None else None
    tables = {id(o): [(s.offset, s.nbytes) for s in segments(o.reader.header)][1:] for o in outgoing}
    # 1. sizes: sidecar, shard, header, segments
    meta = _empty(4, torch.int64)
    ops = [dist.P2POp(dist.irecv, meta, src)] if src is not None else []
    for o in outgoing:
        h = [len(o.sidecar), o.reader.nbytes, o.reader.header.data_start, len(tables[id(o)])]
        ops.append(dist.P2POp(dist.isend, _wire(torch.tensor(h, dtype=torch.int64)), o.dst))
    for w in _wait(ops):
        w.wait()
    sc_len, size, hdr_len, nseg = (int(x) for x in meta.cpu())
    problem = None
    if src is not None and not (0 < sc_len <= _MAX_SIDECAR and 8 <= hdr_len <= size and 0 <= nseg <= size):
        # a sender only offers a copy whose header it validated: this cannot come from one
        problem = f"rank {src} announced a {sc_len}-byte sidecar and a {size}-byte shard"
        src = None
    # 2. sidecar, header, segment table
    ops = []
    if src is not None:
        sc_buf, hdr_buf, tab_buf = _empty(sc_len), _empty(hdr_len), _empty(2 * nseg, torch.int64)
        ops += [dist.P2POp(dist.irecv, b, src) for b in (sc_buf, hdr_buf, tab_buf) if b.numel()]
    for o in outgoing:
        tab = torch.tensor([x for seg in tables[id(o)] for x in seg], dtype=torch.int64)
        bufs = [torch.frombuffer(bytearray(o.sidecar), dtype=torch.uint8), o.reader.raw()[: o.reader.header.data_start], tab]
        ops += [dist.P2POp(dist.isend, _wire(b), o.dst) for b in bufs if b.numel()]
    for w in _wait(ops):
        w.wait()
    recv = None
    wire = wires.for_backend(_nccl())
    if src is not None:
        recv = Received(rank, step, incoming, ring, job=job, node=node, timeout_s=timeout_s)  # type: ignore[arg-type]
        recv.wire = wire
        recv.prepare(bytes(sc_buf.cpu().numpy()), bytes(hdr_buf.cpu().numpy()), tab_buf.cpu().tolist(), size)
    # 3. the data segments, in bounded pieces (recovery/wire.py)
    try:
        _move_data(wire, src, recv, outgoing, tables)
    finally:
        wire.close()
    if recv is not None:
        problem = recv.finish()
        return problem, (None if problem else recv)
    return problem, None


def _move_data(wire: Wire, src: int | None, recv: "Received | None", outgoing: list[Outgoing],
               tables: dict[int, list[tuple[int, int]]]) -> None:
    """Every data segment, in bounded pieces (:func:`incluster.recovery.wire.move`); the
    receiver checks each piece as it lands."""
    sends = []
    for o in outgoing:
        raw = o.reader.raw()
        sends += [(o.dst, raw[a : a + n]) for a, n in tables[id(o)] if n]
    recvs: list[tuple[int, torch.Tensor, Any]] = []
    if recv is not None and src is not None:
        recvs = [(src, recv.dest(i), recv.landed) for i, (_, n) in enumerate(recv.table) if n]
        recv.order = [i for i, (_, n) in enumerate(recv.table) if n]
    move(wire, sends, recvs)


class Received:
    """The receiving end of one shard: checks and lands it; :meth:`heal` writes and
    commits the node's copy later."""

    def __init__(self, rank: int, step: int, inc: Incoming, ring: SlotRing, *, job: str, node: str, timeout_s: float) -> None:
        self.rank, self.step, self.inc, self.ring = rank, step, inc, ring
        self.job, self.node, self.timeout_s = job, node, timeout_s
        self.where = f"rank {rank}'s shard of step {step} received from rank {inc.source}"
        self.problem: str | None = None
        self.slot: Any = None
        self.landing: Landing | None = None
        self.sidecar: Sidecar | None = None
        self.pending: list[tuple[int, torch.Tensor]] = []  # (file offset, verified bytes) to write
        self.dests: list[torch.Tensor | None] = []
        self.order: list[int] = []  # the segment each received message is
        self.wire: Wire = Wire(torch.device("cpu"))  # the transfer's (set before prepare)
        self.heal_error: str | None = None  # why this node's copy cannot be written, if so

    @property
    def can_heal(self) -> bool:
        """Whether :meth:`heal` has a slot to write this node's copy into."""
        return self.slot is not None and self.problem is None

    def prepare(self, raw_sc: bytes, hdr: bytes, tab: list[int], size: int) -> None:
        self.table = [(tab[i], tab[i + 1]) for i in range(0, len(tab), 2)]
        sizes = [n for _, n in self.table]
        try:
            sc = parse_received_sidecar(raw_sc, self.where, rank=self.rank, step=self.step, job=self.job, size=size)
            header = parse_header(hdr, size, self.where)
            segs = segments(header)
            if [(s.offset, s.nbytes) for s in segs[1:]] != self.table:
                raise CorruptCheckpointError(f"{self.where}: the sender cut the shard differently")
            self.verifier = ChunkVerifier(sc.checksum, self.where)
            self.verifier.update(hdr)
        except CorruptCheckpointError as exc:
            self.problem = str(exc)
            self.dests = [None] * len(sizes)  # taken in by the wire's own buffers, thrown away
            return
        targets: dict[str, torch.Tensor] = {}
        if sc.world_size == self.inc.world_size:  # else the load refuses it before any byte is used
            # live tensors on the wire's GPU take their pieces as they come (NCCL)
            devices = ("cpu", "cuda") if self.wire.device.type == "cuda" else ("cpu",)
            try:
                targets = direct_targets(
                    self.inc.state, sc.tree, header, allow_pickle=self.inc.allow_pickle, devices=devices
                )
            except CheckpointError:
                targets = {}  # the load reports the mismatch; nothing lands in the live state
        self.sidecar, self.landing = sc, Landing(header, segs, targets)
        self.dests = list(self.landing.dests[1:])
        try:
            self.slot = self.ring.acquire_for_restore(self.step)
            self.ring.open_for_writes(self.slot, size)
            self.ring.write_at(self.slot, 0, [hdr])
        except (OSError, CheckpointError) as exc:
            # No room for the node's copy (a full RAM disk, no free slot): the shard still
            # lands in the live state, verified; only the heal is skipped. Raising here
            # would leave the sender blocked in the next round until the group times out.
            self._no_heal(exc)

    def dest(self, i: int) -> torch.Tensor:
        """Where segment ``i`` lands (a ``meta`` tensor: taken in and thrown away)."""
        dest = self.dests[i]
        if self.problem is not None or dest is None:
            return torch.empty(self.table[i][1], dtype=torch.uint8, device="meta")
        return dest

    def landed(self, m: int, start: int, piece: torch.Tensor) -> None:
        """Bytes ``start:`` of the ``m``-th segment received are in place (pieces arrive in
        file order): check them. A piece in host memory is written to this node's copy by
        :meth:`heal`, once its segment is complete; one in a live GPU tensor is written
        now, from the host copy it was hashed in (no second pass over the device)."""
        if self.problem is not None:
            return
        i = self.order[m]
        host = self.wire.host_view(piece)
        view = memoryview(host.numpy())  # type: ignore[arg-type]
        for at in range(0, view.nbytes, PIECE):  # each piece hashed while it is in the cache
            try:
                self.verifier.update(view[at : at + PIECE])
            except CorruptCheckpointError as exc:
                self.problem = str(exc)
                return
        offset, size = self.table[i]
        if piece.device.type == "cpu":
            if start + piece.numel() == size:
                self.pending.append((offset, self.dests[i]))  # type: ignore[arg-type]
        elif self.slot is not None:
            try:
                self.ring.write_at(self.slot, offset + start, [view])
            except (OSError, CheckpointError) as exc:  # a full RAM disk: the state still lands, verified
                self._no_heal(exc)

    def _no_heal(self, exc: BaseException) -> None:
        if self.slot is not None:
            self.ring.release(self.slot)
            self.slot = None
        self.heal_error = f"{type(exc).__name__}: {exc}"
        log.warning("incluster: %s lands in the live state, but this node's copy cannot be written (%s); "
                    "the next save writes one as usual", self.where, self.heal_error)

    def finish(self) -> str | None:
        if self.problem is None:
            try:
                self.verifier.finish()
            except CorruptCheckpointError as exc:
                self.problem = str(exc)
        if self.problem is not None:
            if self.slot is not None:
                self.ring.release(self.slot)
            return self.problem
        return None

    def keep_apart(self, changing: set[int]) -> None:
        """Copy the verified bytes of live tensors that may change before :meth:`heal`
        runs (ones the optimizer pre-step hook does not guard: module buffers, plain
        tensors); ``changing`` holds their data pointers."""
        self.pending = [(off, t.clone() if t.data_ptr() in changing else t) for off, t in self.pending]

    def heal(self) -> None:
        """Write the verified bytes into the slot and commit it, like a local save."""
        if self.slot is None:
            raise CheckpointError(f"{self.where}: this node's copy cannot be written: {self.heal_error}")
        for off, t in self.pending:
            self.ring.write_at(self.slot, off, [t.numpy()])
        self.pending = []
        if self.sidecar is None:  # set by prepare() whenever no problem was found
            raise CheckpointError("a received shard reached its commit without a sidecar; please report this")
        self.sidecar = commit_received(
            self.ring, self.slot, self.sidecar, f"rank {self.inc.source}'s copy", node=self.node, verified=True,
            restored_from_rank=self.inc.source,
        )

    def abandon(self) -> None:
        self.pending = []
        if self.slot is not None:
            self.ring.release(self.slot)
            self.slot = None
