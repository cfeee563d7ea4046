"""Restore planning: pure, deterministic functions over who holds what. No I/O.

Input: the job's topology (node of every current rank) and, per node, the (owner rank,
step, bytes, world size it was saved by) shards its RAM folder holds. Output: the newest
step of which some node holds a copy of every shard (ranks 0..W-1 of the world that saved
it), and for each rank where its shard comes from: its own node, or a rank on a node that
holds a copy, chosen to spread bytes over the holders. Copies found bad are excluded and
the plan is made again. A shard with no usable copy left is rebuilt where a
byte-identical shard of another rank is (:mod:`incluster.recovery.equivalent`): the plan
is then a forwarding round, and the next plan uses the rebuilt copies.

A step saved by a different world size is restored by resharding
(:mod:`incluster.recovery.reshard`): each old shard gets one current rank on a node that
holds it (its server), preferring the rank of the same number; every rank then computes
which pieces it needs from which server itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from incluster.errors import CheckpointError
from incluster.recovery.equivalent import StandIns, plan_forwards
from incluster.topology import Topology

Holdings = Mapping[str, Iterable[tuple[int, ...]]]  # node -> {(owner, step[, size[, world[, content]]])}
ANY_WORLD = -1  # a copy whose world size is unknown (its sidecar unread): counted for any


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
    world: int | None = None  # the step was saved by this many ranks (not ours): reshard
    reshard: bool = False  # reshard even at the same world size (the live mesh differs)
    forwarding: bool = False  # this round only forwards sidecars (every rank takes part)
    forward_send: tuple[tuple[int, int], ...] = ()  # (owner, to rank): send that owner's sidecar
    forward_recv: tuple[tuple[int, int, int, str], ...] = ()  # (owner, from rank, bytes of, from node)
    lineage: tuple[int, int, int] | None = None  # the timeline of the step's copies (recovery/lineage.py)
    afresh: bool = False  # no step was ever complete: start afresh, dropping this node's copies of them


@dataclass
class Plan:
    step: int | None
    ranks: list[RankPlan]
    missing: dict[int, list[int]] = field(default_factory=dict)  # newest steps -> owners lacking
    world: int | None = None  # the chosen step's world size
    server_of: list[int] = field(default_factory=list)  # reshard: old rank -> current rank reading it
    missing_world: dict[int, int] = field(default_factory=dict)  # of those: the world that saved it, if not this one


Holders = Mapping[tuple[int, int], list[tuple[str, int]]]  # (owner, step) -> [(node, world)]


def index_holders(holdings: Holdings, topo: Topology, exclude: set[tuple[str, int, int]] = frozenset()) -> dict[tuple[int, int], list[tuple[str, int]]]:  # type: ignore[assignment]
    """(owner, step) -> (node, saved world size) of every copy, in group order, only nodes
    of this job."""
    live = set(topo.nodes)
    order = {n: i for i, n in enumerate(topo.nodes)}
    holders: dict[tuple[int, int], list[tuple[str, int]]] = defaultdict(list)
    for node, items in holdings.items():
        if node not in live:
            continue
        for item in set(items):
            owner, step = item[0], item[1]
            world = item[3] if len(item) > 3 else ANY_WORLD
            if len(item) > 2 and item[2] < 0:
                continue  # a sidecar whose bytes are gone: not a copy (see equivalent.py)
            if owner >= 0 and (node, owner, step) not in exclude:
                holders[(owner, step)].append((node, world))
    for nodes in holders.values():
        nodes.sort(key=lambda h: order[h[0]])
    return holders


def nodes_of(holders: Holders, owner: int, step: int, world: int) -> list[str]:
    """Nodes holding a copy of ``owner``'s shard of ``step`` saved by ``world`` ranks."""
    return [n for n, w in holders.get((owner, step), ()) if w in (world, ANY_WORLD)]


def choose_step(
    holders: Holders, world: int, rebuild: Callable[[int, int, int], bool] | None = None
) -> tuple[int | None, int | None, dict[int, list[int]], dict[int, int]]:
    """Newest step with a copy of every shard of the world that saved it (this job's
    world size preferred; ``rebuild(owner, step, world)``: that shard, with no copy, can be
    rebuilt); that world size; for newer steps, which ranks lack a copy - ranks of the
    world that saved the step - and that world where it is not this one."""
    per_step: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for (owner, step), copies in holders.items():
        for _, w in copies:
            per_step[step][w].add(owner)
    missing: dict[int, list[int]] = {}
    saved_by: dict[int, int] = {}
    for step in sorted(per_step, reverse=True):
        by_world = per_step[step]
        unknown = by_world.get(ANY_WORLD, set())
        worlds = [world] + sorted((w for w in by_world if w > 0 and w != world), reverse=True)
        for w in worlds:
            have = {o for o in by_world.get(w, set()) | unknown if o < w}
            if len(have) == w or (rebuild is not None and all(rebuild(o, step, w) for o in range(w) if o not in have)):
                return step, w, missing, saved_by
        # Name the lacking shards of the world that saved this step (an old world's after a
        # resize, not this world's ranks, none of which it ever had).
        w = world if world in by_world or len(worlds) == 1 else max(
            worlds[1:], key=lambda x: (len({o for o in by_world[x] | unknown if o < x}) / x, x))
        missing[step] = sorted(set(range(w)) - by_world.get(w, set()) - unknown)
        if w != world:
            saved_by[step] = w
    return None, None, missing, saved_by


def make_plan(
    topo: Topology, holdings: Holdings, exclude: set[tuple[str, int, int]] | None = None, *, force_reshard: bool = False
) -> Plan:
    """The restore plan for every rank (identical input gives an identical plan);
    ``force_reshard``: a resharding plan even at the same world size."""
    exclude = exclude or set()
    holders = index_holders(holdings, topo, exclude)
    stand_ins = StandIns(holdings, topo, exclude)
    step, world, missing, saved_by = choose_step(holders, topo.world_size, stand_ins.can_rebuild)
    if step is None or world is None:
        return Plan(None, [RankPlan(None) for _ in range(topo.world_size)], missing, missing_world=saved_by)
    ranks_on = defaultdict(list)
    for r, n in enumerate(topo.node_of):
        ranks_on[n].append(r)
    lacking = [o for o in range(world) if not nodes_of(holders, o, step, world)]
    if lacking:
        forwards = plan_forwards(lacking, step, world, *stand_ins.index, topo, ranks_on, exclude)
        if len(forwards) != len(lacking):
            raise CheckpointError(f"the restore plan for step {step} found no way to rebuild rank(s) {lacking}; please report this")
        return _forward_plan(topo, forwards, missing)
    if world != topo.world_size or force_reshard:
        return _reshard_plan(topo, holders, step, world, ranks_on, missing)
    load: dict[int, int] = defaultdict(int)  # shards each rank sends
    source: list[int | None] = [None] * topo.world_size
    sends: dict[int, list[int]] = defaultdict(list)
    for r in range(topo.world_size):
        nodes = nodes_of(holders, r, step, world)
        if topo.node_of[r] in nodes:
            continue  # my own node has my shard
        candidates = [s for n in nodes for s in ranks_on[n]]
        src = min(candidates, key=lambda s: (load[s], s))
        load[src] += 1
        source[r] = src
        sends[src].append(r)
    any_transfer = any(s is not None for s in source)
    sizes = {(i[0], i[1]): i[2] for items in holdings.values() for i in items if len(i) > 2 and i[2] >= 0}
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
    return Plan(step, ranks, missing, world)


def _reshard_plan(
    topo: Topology, holders: Holders, step: int, world: int, ranks_on: Mapping[str, list[int]], missing: dict[int, list[int]]
) -> Plan:
    """One server per old shard: the rank of the same number where its node holds a copy,
    else the least loaded rank on a node that does. O(old world x ranks per node)."""
    load: dict[int, int] = defaultdict(int)
    server_of = []
    for o in range(world):
        nodes = nodes_of(holders, o, step, world)
        if o < topo.world_size and topo.node_of[o] in nodes:
            s = o
        else:
            s = min((c for n in nodes for c in ranks_on[n]), key=lambda c: (load[c], c))
        load[s] += 1
        server_of.append(s)
    ranks = [RankPlan(step, None, (), None, world=world, reshard=True) for _ in range(topo.world_size)]
    return Plan(step, ranks, missing, world, server_of)


def _forward_plan(topo: Topology, forwards: list, missing: dict[int, list[int]]) -> Plan:  # type: ignore[type-arg]
    """A round in which sidecars go where identical bytes are; every rank takes part (and
    re-plans after it), the ranks named send or receive."""
    sends: dict[int, list[tuple[int, int]]] = defaultdict(list)
    recvs: dict[int, list[tuple[int, int, int, str]]] = defaultdict(list)
    for f in forwards:
        sends[f.sender].append((f.owner, f.receiver))
        recvs[f.receiver].append((f.owner, f.sender, f.bytes_of, f.sender_node))
    step = forwards[0].step
    ranks = [
        RankPlan(step, forwarding=True, forward_send=tuple(sends[r]), forward_recv=tuple(recvs[r]))
        for r in range(topo.world_size)
    ]
    return Plan(step, ranks, missing)
