"""Who runs where, and where each rank's replicas go. Pure functions, no I/O.

Nodes are ordered by their lowest rank (the process group's order). Rank r on node i
with local rank l sends replica k (1..replicas) to local rank l on node (i + k) mod n
(l wraps when that node has fewer ranks). Replicas never land on the owner's node; with
one node there is nowhere to put them, so replication is off (the caller warns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence


@dataclass(frozen=True)
class Topology:
    """``node_of[r]`` is the node name of rank r. Indexes are built once (O(W))."""

    node_of: tuple[str, ...]
    _ranks_on: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _local: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for r, n in enumerate(self.node_of):
            ranks = self._ranks_on.setdefault(n, [])
            self._local.append(len(ranks))
            ranks.append(r)

    @classmethod
    def from_nodes(cls, node_of: Sequence[str]) -> "Topology":
        if not node_of:
            raise ValueError("a topology needs at least one rank")
        return cls(tuple(node_of))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in group order (by each node's lowest rank)."""
        return tuple(self._ranks_on)

    def ranks_on(self, node: str) -> list[int]:
        return self._ranks_on.get(node, [])

    def local_rank(self, rank: int) -> int:
        return self._local[rank]

    def node_index(self, node: str) -> int:
        return self._order[node]

    @cached_property
    def _order(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self._ranks_on)}

    def effective_replicas(self, replicas: int) -> int:
        """Replicas that can be placed: at most one per other node."""
        return max(0, min(replicas, len(self._ranks_on) - 1))


def replica_targets(topo: Topology, rank: int, replicas: int) -> list[int]:
    """The ranks that keep ``rank``'s replicas 1..replicas, in order."""
    nodes = topo.nodes
    i = topo.node_index(topo.node_of[rank])
    local = topo.local_rank(rank)
    out = []
    for k in range(1, topo.effective_replicas(replicas) + 1):
        peers = topo.ranks_on(nodes[(i + k) % len(nodes)])
        out.append(peers[local % len(peers)])
    return out


def replica_sources(topo: Topology, rank: int, replicas: int) -> list[tuple[int, int]]:
    """(source rank, k) pairs whose replica k this rank keeps, sorted by source."""
    out = []
    for src in range(topo.world_size):
        for k, dst in enumerate(replica_targets(topo, src, replicas), start=1):
            if dst == rank:
                out.append((src, k))
    return out
