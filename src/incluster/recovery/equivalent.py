"""Identical shards stand in for each other (planning only; pure, no I/O).

Data-parallel ranks save byte-identical shards. When every copy of one rank's shard of
a step is lost or bad, the step is still whole if some live node keeps that rank's
*sidecar* (its bytes gone or corrupt) and another node holds, unexcluded, a shard of the
same step with the same content id (the digest of its checksum record, in every
sidecar's head). A forwarding round (:mod:`incluster.recovery.forward`) then sends the
sidecar to a rank on that node, which compares the whole checksum records before it
commits it as a shared copy there; the next round restores it like any other copy,
every chunk checked against the owner's own checksums.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

from incluster.topology import Topology

SIDECAR_BAD = "<sidecar>"  # exclusion of (SIDECAR_BAD + node, owner, step): that sidecar is unusable
_ANY = -1
_CHOICES = 16  # stand-ins weighed per rebuilt shard

Sidecars = Mapping[tuple[int, int], list[tuple[str, int, int]]]  # (owner, step) -> [(node, world, content)]
Contents = Mapping[tuple[int, int], list[tuple[str, int, int]]]  # (step, content) -> [(node, owner, world)]


@dataclass(frozen=True)
class Forward:
    owner: int  # whose shard is rebuilt
    step: int
    sender: int  # a rank on the node that keeps the owner's sidecar
    sender_node: str
    receiver: int  # a rank on the node that holds identical bytes
    bytes_of: int  # whose shard holds them there


def index(
    holdings: Mapping[str, Iterable[tuple[int, ...]]], topo: Topology, exclude: set[tuple[str, int, int]]
) -> tuple[dict[tuple[int, int], list[tuple[str, int, int]]], dict[tuple[int, int], list[tuple[str, int, int]]]]:
    """Sidecars with a known content id (bytes present or not, unless the sidecar itself
    was found unusable), and usable copies by (step, content id); live nodes only."""
    live = set(topo.nodes)
    sidecars: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    contents: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    for node, items in holdings.items():
        if node not in live:
            continue
        for item in set(items):
            if len(item) < 5 or item[4] == 0:
                continue
            owner, step, size, world, content = item[:5]
            if owner < 0:
                continue
            if (SIDECAR_BAD + node, owner, step) not in exclude:
                sidecars[(owner, step)].append((node, world, content))
            if size >= 0 and (node, owner, step) not in exclude:
                contents[(step, content)].append((node, owner, world))
    order = {n: i for i, n in enumerate(topo.nodes)}
    for lst in list(sidecars.values()) + list(contents.values()):
        lst.sort(key=lambda h: (order[h[0]], h[1]))
    return sidecars, contents


def _stand_ins(
    sidecars: Sidecars, contents: Contents, owner: int, step: int, world: int, exclude: set[tuple[str, int, int]]
) -> Iterator[tuple[str, str, int]]:
    """(sidecar node, bytes node, bytes owner) pairs that can rebuild ``owner``'s shard, in
    order, lazily. A node where a copy of the owner itself was found bad is never the
    bytes node: a copy rebuilt there that then failed is not rebuilt there again."""
    for a, w, content in sidecars.get((owner, step), ()):
        if w not in (world, _ANY):
            continue
        for b, p, w2 in contents.get((step, content), ()):
            if p != owner and w2 in (world, _ANY) and (b, owner, step) not in exclude:
                yield a, b, p


class StandIns:
    """The index of sidecars and identical copies, built the first time it is needed (a
    plan where every shard has a copy never builds it)."""

    def __init__(self, holdings: Mapping[str, Iterable[tuple[int, ...]]], topo: Topology,
                 exclude: set[tuple[str, int, int]]) -> None:
        self.holdings, self.topo, self.exclude = holdings, topo, exclude
        self._index: tuple[Sidecars, Contents] | None = None

    @property
    def index(self) -> tuple[Sidecars, Contents]:
        if self._index is None:
            self._index = index(self.holdings, self.topo, self.exclude)
        return self._index

    def can_rebuild(self, owner: int, step: int, world: int) -> bool:
        """A forwarding round can rebuild that shard (asked only for shards with no usable
        copy; stops at the first stand-in)."""
        return next(_stand_ins(*self.index, owner, step, world, self.exclude), None) is not None


def plan_forwards(
    lacking: list[int], step: int, world: int, sidecars: Sidecars, contents: Contents, topo: Topology,
    ranks_on: Mapping[str, list[int]], exclude: set[tuple[str, int, int]],
) -> list[Forward]:
    """One forward per lacking owner: to the owner's own node where it holds identical
    bytes (the owner then reads locally), else to the least loaded of the first
    ``_CHOICES`` nodes that do (bounded work per owner, whatever the world size)."""
    load: dict[int, int] = defaultdict(int)
    per_node: dict[str, int] = defaultdict(int)
    out = []
    for o in lacking:
        home = topo.node_of[o] if o < topo.world_size else None
        pairs = []
        for pair in _stand_ins(sidecars, contents, o, step, world, exclude):
            pairs.append(pair)
            if pair[1] == home or len(pairs) >= _CHOICES:
                break
        if not pairs:
            continue
        a, b, p = min(pairs, key=lambda t: (t[1] != home, per_node[t[1]], t[0] != t[1]))
        per_node[b] += 1
        receiver = o if b == home else min(ranks_on[b], key=lambda r: (load[r], r))
        sender = receiver if a == b else min(ranks_on[a], key=lambda r: (load[r], r))  # same node: no message
        load[receiver] += 1
        load[sender] += 1
        out.append(Forward(o, step, sender, a, receiver, p))
    return out
