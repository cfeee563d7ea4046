"""Who sends which piece of which DTensor to whom in a resharding restore: pure, no I/O.

Both ends compute the same lists from the same inputs, so no table of pieces is ever
sent: the old layout of every tensor (from any old rank's tree: an SPMD job cuts every
rank's tensors alike), the new layout (from the live DTensors), the server of every old
shard and the node of every current rank (:class:`Maps`, broadcast by rank 0).

A piece is the overlap of one old shard's box and one new rank's box, of one tensor.
Where the old placements replicate (``Replicate`` on a mesh dimension: HSDP's replica
dimension, or DDP-style DTensors), several old shards hold the same box; the receiver
takes it from one of them, the one whose server is on its own node if there is one.
Pieces of one (server, receiver) pair go in (old rank, tensor name) order.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from incluster.recovery.boxes import Box, Layout, coord_of, rank_of


@dataclass(frozen=True)
class Maps:
    """The plan every rank shares: the server of each old rank, the node (index) of each
    current rank."""

    server_of: Sequence[int]
    node_of: Sequence[int]

    @property
    def old_world(self) -> int:
        return len(self.server_of)


@dataclass(frozen=True)
class Piece:
    owner: int  # the old rank whose shard holds it
    name: str  # the tensor (the same name in every rank's tree)
    box: Box  # where it lies in the global tensor


def source_of(rank: int, old_world: int, rule: str, new_world: int | None = None) -> int | None:
    """The old rank whose own values (those DTensor placements do not cut) ``rank`` takes;
    None when the rule refuses. At the same world size (another mesh) every rank keeps its
    own, whatever the rule."""
    if new_world == old_world:
        return rank
    if rule == "rank0":
        return 0
    if rule == "same-rank":
        return rank % old_world
    return None


class _Group:
    """Old ranks holding one box (they differ only on replicated mesh dimensions), ready
    to answer "which one does this receiver read" in O(1)."""

    def __init__(self, members: Sequence[int], maps: Maps) -> None:
        self.members = sorted(members)
        self.by_node: dict[int, int] = {}
        for m in self.members:  # the lowest member served on each node
            self.by_node.setdefault(maps.node_of[maps.server_of[m]], m)

    def pick(self, receiver: int, maps: Maps) -> int:
        near = self.by_node.get(maps.node_of[receiver])
        return near if near is not None else self.members[receiver % len(self.members)]


def choose_owner(members: Sequence[int], receiver: int, maps: Maps) -> int:
    """Of old ranks holding the same box, the one ``receiver`` reads: one served on its
    own node if any (the lowest), else one picked by its rank (spreading the load)."""
    return _Group(members, maps).pick(receiver, maps)


def _replicas(lay: Layout, coord: tuple[int, ...]) -> list[int]:
    """Old ranks holding the same box as ``coord`` (it varies only on replicated dims)."""
    rdims = lay.replicated_dims()
    out = []
    for alt in itertools.product(*(range(lay.mesh_shape[i]) for i in rdims)):
        c = list(coord)
        for i, v in zip(rdims, alt):
            c[i] = v
        out.append(rank_of(c, lay.mesh_shape))
    return out


def _group(lay: Layout, coord: tuple[int, ...], maps: Maps, cache: dict) -> _Group:  # type: ignore[type-arg]
    """The group of ``coord``'s box; groups depend only on the mesh, the placements and
    the coordinate, so tensors cut alike share them."""
    rdims = lay.replicated_dims()
    key = (lay.mesh_shape, lay.placements, tuple(0 if i in rdims else c for i, c in enumerate(coord)))
    g = cache.get(key)
    if g is None:
        g = cache[key] = _Group(_replicas(lay, coord), maps)
    return g


def receiver_pieces(rank: int, old: Mapping[str, Layout], mine: Mapping[str, Box], maps: Maps) -> list[Piece]:
    """Every piece ``rank`` needs: per tensor, the overlaps of its box with the old
    shards' boxes (one shard per replicated box), sorted by (old rank, name)."""
    out, cache = [], {}  # type: ignore[var-annotated]
    for name in sorted(mine):
        lay = old[name]
        for coord, inter in lay.overlapping(mine[name], walk_replicated=False):
            out.append(Piece(_group(lay, coord, maps, cache).pick(rank, maps), name, inter))
    out.sort(key=lambda p: (p.owner, p.name))
    return out


def server_pieces(
    owner: int, old: Mapping[str, Layout], new: Mapping[str, Layout], maps: Maps
) -> Iterator[tuple[int, Piece]]:
    """(receiver, piece) for every piece of old rank ``owner``'s shard that some current
    rank reads from it, in (name, receiver) order."""
    cache: dict = {}  # type: ignore[type-arg]
    for name in sorted(old):
        lay = old[name]
        mine = coord_of(owner, lay.mesh_shape)
        have = lay.box(mine)
        if min(have[1], default=1) == 0:
            continue
        group = _group(lay, mine, maps, cache)
        nl = new[name]
        for coord, inter in nl.overlapping(have):
            r = rank_of(coord, nl.mesh_shape)
            if group.pick(r, maps) == owner:
                yield r, Piece(owner, name, inter)


def layout_digest(old: Mapping[str, Layout], new: Mapping[str, Layout], rule: str, old_world: int) -> int:
    """A signed 64-bit digest of everything the piece lists depend on: every rank must
    compute the same one, or the pieces would not match up."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{rule}|{old_world}".encode())
    for name in sorted(old):
        h.update(repr((name, old[name], new.get(name))).encode())
    return int.from_bytes(h.digest(), "little", signed=True)
