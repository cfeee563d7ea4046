"""Restore a step saved by a different world size, from the shards in the cluster's RAM.

Rank 0's plan gives each old shard a server: a current rank on a node holding a copy
(:func:`incluster.recovery.plan.make_plan`), and broadcasts who serves what and which
node each rank is on (O(W) integers). Then, on every rank:

1. serve: open the old shards it serves, check their identity and that their recorded
   boxes match DTensor's arithmetic, work out every piece it will read from them
   (:mod:`incluster.recovery.reshard_pieces`) and check every checksum chunk those
   pieces touch, before any byte moves. A bad copy: every rank re-plans without it.
   A shard that cannot be resharded: every rank stops, nothing changed.
2. sources: each rank gets the sidecar and header of the old rank whose own values it
   takes (``reshard_rank_state``) from that shard's server.
3. agree: each rank works out the pieces it needs from its live DTensors and checks the
   saved state fits the live one; one all-reduce stops every rank together if one cannot
   go on, or if their layouts differ.
4. move: point-to-point operations in bounded pieces (:mod:`incluster.recovery.wire`). A
   piece lands straight in the slice of the live local tensor it belongs to where that
   slice is contiguous (and, under NCCL, on the GPU); a piece this rank serves itself is
   copied from the mapped file. The source rank's plain tensors and
   leaves come whole; ``load_into`` then finishes the state.

Bytes are checked by the rank that reads them from its RAM disk, chunk by chunk against
the sidecar's digests; the transfer itself is trusted to the process group's transport.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable, Mapping

import torch

from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.format.dtypes import NAME_TO_DTYPE
from incluster.format.reader import MAX_HEADER_BYTES, parse_header
from incluster.format.sidecar import MAX_SIDECAR_BYTES
from incluster.recovery.boxes import local_slices
from incluster.recovery.landing import direct_targets
from incluster.recovery.meet import ranges
from incluster.recovery.gather import active_dist as _dist
from incluster.recovery.node import bad_copy, uncommit
from incluster.recovery.reshard_pieces import Maps, Piece, layout_digest, receiver_pieces, server_pieces, source_of
from incluster.recovery import wire as wires
from incluster.recovery.reshard_shard import (
    Live, Shard, byte_span, check_boxes, check_rest, live_layout, open_served, rewritten, shard_of, verify_spans, view_of,
)
from incluster.state_load import CANNOT_LOAD, load_into
from incluster.writer.local_commit import parse_received_sidecar

log = logging.getLogger("incluster")
Collect = Callable[[list[tuple[str, int, int]]], bool]


def _wire_device() -> torch.device:
    from incluster.recovery.gather import device_for_collectives

    return device_for_collectives() if _dist() is not None else torch.device("cpu")


class Reshard:
    """One resharding round on one rank; :meth:`run` returns True when a bad copy was
    found (every rank re-plans) and False once the state is loaded."""

    def __init__(self, ctx: Any, state: Mapping[str, Any], step: int, maps: Maps, report: Any) -> None:
        self.ctx, self.state, self.step, self.maps, self.report = ctx, state, step, maps, report
        self.me, self.world, self.rule = ctx.rank, ctx.world_size, ctx.rank_state
        self.served: dict[int, Shard] = {}
        self.outbox: dict[int, list[tuple[int, Piece]]] = {}  # old rank -> (receiver, piece)
        self.new: dict[int, dict[str, Any]] = {}  # old rank served -> the live layouts for its tree
        self.dirty = False  # bytes landed in the live state

    def run(self, collect: Collect) -> bool:
        try:
            problem, bad = self._serve()
            if collect(bad):
                return True
            # the rule and both world sizes decide who talks to whom next: agree on them first
            self._stop_together(problem, layout_digest({}, {}, self.rule, self.maps.old_world * 1_000_003 + self.world))
            try:
                src: Shard | None = self._source()
            except CheckpointError as exc:  # after every message of the round: the others stop with us
                src, problem = None, str(exc)
            live, pieces, problem, d = self._fit(src) if src is not None else (None, [], problem, 0)
            self._stop_together(problem, d)
            assert src is not None and live is not None
            self.dirty = True
            moved = 0
            try:
                moved = self._move(src, live, pieces)
                load_into(self.state, self._tree, self._fetch, allow_pickle=self.ctx.allow_pickle,
                          placed=self._placed, left_out_ok=self.ctx.left_out_ok)
            except CANNOT_LOAD as exc:  # after the last round: never a rank returning while another raises
                problem = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
            self._stop_together(problem)
        finally:
            for shard in self.served.values():
                if shard.reader is not None:
                    shard.reader.close()
        servers = {self.maps.server_of[p.owner] for p in pieces} | {self.maps.server_of[src.owner]}
        self.report.step, self.report.bytes = self.step, moved
        self.report.source_rank = src.owner
        held = (f"{len(pieces)} DTensor piece(s) from {len(servers)} rank(s)" if pieces
                else "no DTensor pieces (the state holds plain tensors only)")
        self.report.notes.append(
            f"resharded from {self.maps.old_world} ranks: {held}, the plain tensors and values of old rank {src.owner}"
        )
        kept = {source_of(r, self.maps.old_world, self.rule, self.world) for r in range(self.world)}
        dropped = [o for o in range(self.maps.old_world) if o not in kept]
        if dropped and self.me == 0:
            log.warning("incluster: step %d was saved by %d ranks and restored into %d: the own values (plain tensors, "
                        "RNG, data-loader position) of old rank(s) %s are not restored, their DTensor shards are; "
                        "values DDP keeps equal on every rank lose nothing", self.step, self.maps.old_world,
                        self.world, ranges(dropped))
        if src.owner != self.me:
            why = "it did not exist in the old world" if self.me >= self.maps.old_world else f"reshard_rank_state={self.rule!r}"
            log.warning("incluster: rank %d took its own values (plain tensors, RNG, data-loader position) from old "
                        "rank %d: %s", self.me, src.owner, why)
        return False

    # 1. serve ------------------------------------------------------------------------
    def _serve(self) -> tuple[str | None, list[tuple[str, int, int]]]:
        ctx, problem, bad = self.ctx, None, []
        for o in range(self.maps.old_world):
            if self.maps.server_of[o] != self.me:
                continue
            try:
                shard = open_served(ctx, self.step, o, self.maps.old_world)
            except CorruptCheckpointError as exc:
                bad_copy(ctx, self.report, o, self.step, exc)
                uncommit(ctx.local_dir, ctx.job, o, self.step)
                bad.append((ctx.node, o, self.step))
                continue
            except (CheckpointError, OSError) as exc:  # OSError: its files went away meanwhile
                if isinstance(exc, OSError):
                    bad_copy(ctx, self.report, o, self.step, exc)
                    bad.append((ctx.node, o, self.step))
                else:
                    problem = problem or str(exc)
                continue
            self.served[o] = shard
            try:
                check_boxes(shard, self.maps.old_world)
                live = live_layout(self.state, shard, self.me, self.world, self.ctx.allow_pickle)
                self.new[o] = live.new
                self.outbox[o] = list(server_pieces(o, shard.old, live.new, self.maps))
                spans = [(0, shard.header.data_start)]
                spans += [byte_span(shard, p.name, p.box) for _, p in self.outbox[o]]
                if any(source_of(r, self.maps.old_world, self.rule, self.world) == o for r in range(self.world)):
                    spans += [(t.offset, t.offset + t.nbytes) for t in map(shard.header.tensors.__getitem__, shard.rest())]
                verify_spans(shard, spans, shard.reader.path)  # type: ignore[union-attr]
            except CorruptCheckpointError as exc:
                bad_copy(ctx, self.report, o, self.step, exc)
                uncommit(ctx.local_dir, ctx.job, o, self.step)
                bad.append((ctx.node, o, self.step))
            except CheckpointError as exc:
                problem = problem or str(exc)
            except Exception as exc:  # noqa: BLE001 - every rank must reach the next collective
                problem = problem or f"{type(exc).__name__}: {exc}"
        return problem, bad

    def _stop_together(self, problem: str | None, layout: int = 0) -> None:
        """Every rank stops here if any rank has a problem, or if layouts differ."""
        dist = _dist()
        if dist is None:
            if problem:
                raise CheckpointError(problem)
            return
        t = torch.tensor([1 if problem else 0, layout, -layout], dtype=torch.int64, device=_wire_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag, hi, lo = (int(x) for x in t.cpu())
        if problem:
            raise CheckpointError(f"cannot restore step {self.step} into {self.world} ranks: {problem}")
        if flag:
            raise CheckpointError(f"another rank cannot restore step {self.step} into {self.world} ranks; see its log")
        if hi != -lo:
            raise CheckpointError(
                f"the ranks disagree on the layout of step {self.step} or of the live state (different models, "
                f"placements or reshard_rank_state on different ranks); nothing was loaded"
            )

    # 2. sources ----------------------------------------------------------------------
    def _source(self) -> Shard:
        """The shard whose own values this rank takes: served here, or its sidecar and
        header received from its server."""
        dist, maps, old = _dist(), self.maps, self.maps.old_world
        src = source_of(self.me, old, self.rule, self.world)
        if src is None:  # "refuse" (a setting every rank shares): nobody sends either
            raise CheckpointError(
                f"step {self.step} was saved by {old} ranks and this job has {self.world}; reshard_rank_state="
                f"'refuse' forbids restoring it here. Restart with {old} ranks, or set reshard_rank_state to "
                f"'same-rank' or 'rank0'"
            )
        to = [(r, self.served[o]) for r in range(self.world) if r != self.me
              for o in [source_of(r, old, self.rule, self.world)] if o is not None and o in self.served]
        meta = torch.zeros(3, dtype=torch.int64, device=_wire_device())
        remote = maps.server_of[src] != self.me
        ops = [dist.P2POp(dist.irecv, meta, maps.server_of[src])] if remote else []
        for r, sh in to:
            h = [len(sh.sidecar_raw), sh.header.data_start, sh.header.file_size]
            ops.append(dist.P2POp(dist.isend, torch.tensor(h, dtype=torch.int64, device=meta.device), r))
        _run(dist, ops)
        ops, bufs, bad = [], [], None
        if remote:
            n_sc, n_hdr, size = (int(x) for x in meta.cpu())
            if not (0 < n_sc <= MAX_SIDECAR_BYTES and 8 <= n_hdr <= min(size, 8 + MAX_HEADER_BYTES)):
                # refused before allocating; this rank's own sends below still go out
                bad = f"rank {maps.server_of[src]} announced a {n_sc}-byte sidecar and a {n_hdr}-byte header"
            else:
                bufs = [torch.empty(n, dtype=torch.uint8, device=meta.device) for n in (n_sc, n_hdr)]
                ops = [dist.P2POp(dist.irecv, b, maps.server_of[src]) for b in bufs]
        for r, sh in to:
            raw = torch.frombuffer(bytearray(sh.sidecar_raw), dtype=torch.uint8)
            hdr = sh.reader.raw()[: sh.header.data_start]  # type: ignore[union-attr]
            ops += [dist.P2POp(dist.isend, b.to(meta.device), r) for b in (raw, hdr)]
        _run(dist, ops)
        if bad is not None:
            raise CheckpointError(bad)
        if not remote:
            return self.served[src]
        sc_buf, hdr_buf = bufs
        where = f"old rank {src}'s shard of step {self.step} (from rank {maps.server_of[src]})"
        raw_sc = bytes(sc_buf.cpu().numpy())
        sc = parse_received_sidecar(raw_sc, where, rank=src, step=self.step, job=self.ctx.job, size=size)
        return shard_of(src, raw_sc, sc, parse_header(bytes(hdr_buf.cpu().numpy()), size, where), where)

    # 3. agree ------------------------------------------------------------------------
    def _fit(self, src: Shard) -> tuple[Live | None, list[Piece], str | None, int]:
        try:
            live = live_layout(self.state, src, self.me, self.world, self.ctx.allow_pickle)
            check_rest(self.state, src, live, self.ctx.allow_pickle)
            for o, sh in self.served.items():
                if sh.old != src.old or self.new[o] != live.new:
                    raise CheckpointError(f"old rank {o}'s tensors are cut unlike old rank {src.owner}'s")
            pieces = receiver_pieces(self.me, src.old, live.box, self.maps)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the next collective
            return None, [], f"{exc}" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}", 0
        return live, pieces, None, layout_digest(src.old, live.new, self.rule, self.maps.old_world)

    # 4. move -------------------------------------------------------------------------
    def _move(self, src: Shard, live: Live, pieces: list[Piece]) -> int:
        maps, moved = self.maps, 0
        recvs: list[tuple[int, torch.Tensor, Any]] = []
        for p in pieces:
            dest = live.local[p.name][local_slices(p.box, live.box[p.name])]
            if maps.server_of[p.owner] == self.me:
                dest.copy_(view_of(self.served[p.owner], p.name, p.box))
            else:
                recvs.append((maps.server_of[p.owner], dest, None))
            moved += dest.numel() * dest.element_size()
        tree = rewritten(src.tree, live)  # DTensor nodes as they are live: their bytes are in place
        targets = direct_targets(self.state, tree, src.header, allow_pickle=self.ctx.allow_pickle, big=1,
                                 devices=("cpu", "cuda"), strict=False)  # the live shards have the new shapes
        self._tree = tree
        self._placed: dict[str, torch.Tensor] = {**targets, **live.local}
        self._rest: dict[str, torch.Tensor] = {}
        for name in src.rest():
            st = src.header.tensors[name]
            dest = _bytes(targets[name]) if name in targets else torch.empty(st.nbytes, dtype=torch.uint8)
            self._rest[name] = dest
            if not st.nbytes:
                continue
            if maps.server_of[src.owner] == self.me:
                dest.copy_(view_of(src, name).reshape(-1).view(torch.uint8))
            else:
                recvs.append((maps.server_of[src.owner], dest, None))
            moved += st.nbytes
        self._src = src
        sends = [(r, t) for r, items in sorted(self._outgoing().items()) for t in items]
        if sends or recvs:
            wire = wires.for_backend(_wire_device().type == "cuda")
            try:
                wires.move(wire, sends, recvs)  # bounded pieces; a contiguous live slice takes its own
            finally:
                wire.close()
        return moved

    def _outgoing(self) -> dict[int, list[torch.Tensor]]:
        """Per receiver, what this rank sends it: pieces in (old rank, name) order, then
        the whole plain tensors of its source shard if this rank serves that."""
        per: dict[int, list[Piece]] = defaultdict(list)
        for o in self.served:
            for r, p in self.outbox[o]:
                if r != self.me:
                    per[r].append(p)
        old = self.maps.old_world
        rest_to = {r: o for r in range(self.world) if r != self.me
                   for o in [source_of(r, old, self.rule, self.world)] if o is not None and o in self.served}
        out: dict[int, list[torch.Tensor]] = {}
        for r in sorted(set(per) | set(rest_to)):
            items = [view_of(self.served[p.owner], p.name, p.box) for p in sorted(per.get(r, ()), key=lambda p: (p.owner, p.name))]
            if r in rest_to:
                sh = self.served[rest_to[r]]
                items += [view_of(sh, n).reshape(-1).view(torch.uint8) for n in sh.rest() if sh.header.tensors[n].nbytes]
            out[r] = items
        return out

    def _fetch(self, name: str) -> torch.Tensor:
        st = self._src.header.tensors.get(name)
        if st is None or name not in self._rest:
            raise CorruptCheckpointError(f"the state tree names tensor {name!r} but old rank {self._src.owner} lacks it")
        return self._rest[name].view(NAME_TO_DTYPE[st.dtype]).view(st.shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _run(dist: Any, ops: list[Any]) -> None:
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()

