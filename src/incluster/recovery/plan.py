"""Restore planning: pure, deterministic functions over who holds what. No I/O.

Input: the job's topology (node of every current rank) and, per node, the (owner rank,
step) shards its RAM folder holds. Output: the newest step every rank 0..W-1 can be
restored from (a copy on some current node), and for each rank where its shard comes
from: its own node, or a rank on a node that holds a copy, chosen to spread bytes over
the holders. Copies found bad are excluded and the plan is made again.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from incluster.topology import Topology

Holdings = Mapping[str, Iterable[tuple[int, ...]]]  # node -> {(owner, step[, size])}


@dataclass(frozen=True)
class RankPlan:
    """What one rank does in a restore."""

    step: int | None
    source: int | None = None  # rank to receive my shard from; None: read my node's copy
    sends: tuple[int, ...] = ()  # ranks I send their shard to (from my node's copies)
    source_node: str | None = None  # the node my shard comes from
    persistent: dict | None = None  # type: ignore[type-arg]  # restore from tier 2: my manifest record
    size: int | None = None  # bytes I will receive (so I can prepare the slot early)
    transfers: bool = True  # some rank receives its shard from a peer in this plan


@dataclass
class Plan:
    step: int | None
    ranks: list[RankPlan]
    missing: dict[int, list[int]] = field(default_factory=dict)  # newest steps -> owners lacking


def index_holders(holdings: Holdings, topo: Topology, exclude: set[tuple[str, int, int]] = frozenset()) -> dict[tuple[int, int], list[str]]:  # type: ignore[assignment]
    """(owner, step) -> nodes holding it, in group order, only nodes of this job."""
    live = set(topo.nodes)
    order = {n: i for i, n in enumerate(topo.nodes)}
    holders: dict[tuple[int, int], list[str]] = defaultdict(list)
    for node, items in holdings.items():
        if node not in live:
            continue
        for item in set(items):
            owner, step = item[0], item[1]
            if 0 <= owner < topo.world_size and (node, owner, step) not in exclude:
                holders[(owner, step)].append(node)
    for nodes in holders.values():
        nodes.sort(key=order.__getitem__)
    return holders


def choose_step(holders: Mapping[tuple[int, int], list[str]], world: int) -> tuple[int | None, dict[int, list[int]]]:
    """Newest step with a copy of every rank's shard; and, for newer steps, who lacks one."""
    per_step: dict[int, set[int]] = defaultdict(set)
    for owner, step in holders:
        per_step[step].add(owner)
    missing: dict[int, list[int]] = {}
    for step in sorted(per_step, reverse=True):
        owners = per_step[step]
        if len(owners) == world:
            return step, missing
        missing[step] = sorted(set(range(world)) - owners)
    return None, missing


def make_plan(topo: Topology, holdings: Holdings, exclude: set[tuple[str, int, int]] | None = None) -> Plan:
    """The restore plan for every rank (identical input gives an identical plan)."""
    holders = index_holders(holdings, topo, exclude or set())
    step, missing = choose_step(holders, topo.world_size)
    if step is None:
        return Plan(None, [RankPlan(None) for _ in range(topo.world_size)], missing)
    ranks_on = defaultdict(list)
    for r, n in enumerate(topo.node_of):
        ranks_on[n].append(r)
    load: dict[int, int] = defaultdict(int)  # shards each rank sends
    source: list[int | None] = [None] * topo.world_size
    sends: dict[int, list[int]] = defaultdict(list)
    for r in range(topo.world_size):
        nodes = holders[(r, step)]
        if topo.node_of[r] in nodes:
            continue  # my own node has my shard
        candidates = [s for n in nodes for s in ranks_on[n]]
        src = min(candidates, key=lambda s: (load[s], s))
        load[src] += 1
        source[r] = src
        sends[src].append(r)
    any_transfer = any(s is not None for s in source)
    sizes = {(i[0], i[1]): i[2] for items in holdings.values() for i in items if len(i) > 2}
    ranks = [
        RankPlan(
            step,
            source[r],
            tuple(sends[r]),
            topo.node_of[r] if source[r] is None else topo.node_of[source[r]],  # type: ignore[index]
            size=sizes.get((r, step)) if source[r] is not None else None,
            transfers=any_transfer,
        )
        for r in range(topo.world_size)
    ]
    return Plan(step, ranks, missing)
