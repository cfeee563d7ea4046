"""The restore planner alone, at scale (no processes): ``make_plan`` for up to 16,384
simulated ranks, and what the inventory exchange and plan scatter move."""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any

from _common import log  # noqa: E402 - bench/ is not a package
from recovery_ranks import JOB

PLAN_TARGET_S = 1.0


def planner_case(world: int, rpn: int, runs: int, swaps: int = 4, check_placement: bool = False) -> dict[str, Any]:
    from incluster.recovery.plan import RankPlan, make_plan
    from incluster.topology import Topology, replica_targets

    n_nodes = world // rpn
    names = [f"node{i:05d}" for i in range(n_nodes)]
    steps = (990, 1000)  # keep=2: two steps held everywhere
    before = Topology.from_nodes([names[r // rpn] for r in range(world)])
    if check_placement:  # the rule used below is the library's (DESIGN §5), checked on a sample
        for r in range(0, world, max(1, world // 64)):
            t = replica_targets(before, r, 1)
            i, l = divmod(r, rpn)
            assert t == [((i + 1) % n_nodes) * rpn + l], (r, t)
    held: dict[str, list[tuple[int, ...]]] = {n: [] for n in names}
    for r in range(world):
        i = r // rpn
        for s in steps:
            # the inventory as node_inventory lists it: (owner, step, bytes, world, content id);
            # one content id for all: data-parallel shards, the planner's worst case
            item = (r, s, 1 << 30, world, 0x5EED0000 + s)
            held[names[i]].append(item)
            held[names[(i + 1) % n_nodes]].append(item)  # replica 1: next node, same local rank
    after = list(names)
    lost = n_nodes // 3
    after[lost] = "spare-0"
    pairs = [(1 + 7 * k, n_nodes - 2 - 11 * k) for k in range(swaps)]
    for a, b in pairs:
        after[a], after[b] = after[b], after[a]
    holdings = {n: v for n, v in held.items() if n != names[lost]}
    holdings["spare-0"] = []
    topo = Topology.from_nodes([after[r // rpn] for r in range(world)])
    times, plan = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = make_plan(topo, holdings)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    peers = [p for p in plan.ranks if p.source is not None]
    sends = [len(p.sends) for p in plan.ranks]
    # what the restore's exchange moves: rank 0 gathers (node, inventory or None) from every
    # rank (only local rank 0 of each node lists its folder) and scatters each rank's plan
    objs = [(after[r // rpn], holdings[after[r // rpn]] if r % rpn == 0 else None) for r in range(world)]
    sizes = [len(pickle.dumps(o)) for o in objs]
    plan_sizes = [len(pickle.dumps(p)) for p in plan.ranks]
    # the whole rank-0 planning round from the gathered list (library code, if present)
    round_s = None
    try:
        from incluster.recovery import restore as _restore
        from incluster.recovery.plan_round import plan_round

        ctx = _restore.Context(local_dir="/nonexistent", job=JOB, rank=0, world_size=world, node=after[0],
                               ring=None, allow_pickle=False, timeout_s=1.0)  # type: ignore[arg-type]
        rts = []
        for _ in range(max(1, runs // 2)):
            t0 = time.perf_counter()
            mine = plan_round(ctx, objs, set())
            rts.append(time.perf_counter() - t0)
        assert isinstance(mine, RankPlan) and mine.step == steps[-1]
        round_s = statistics.median(rts)
    except Exception as exc:  # noqa: BLE001 - informational only
        log(f"  plan round not timed: {type(exc).__name__}: {exc}")
    return {
        "world": world,
        "nodes": n_nodes,
        "ranks_per_node": rpn,
        "lost_node": names[lost],
        "swapped": [(names[a], names[b]) for a, b in pairs],
        "make_plan_s": times,
        "make_plan_median_s": statistics.median(times),
        "plan_round_median_s": round_s,
        "step": plan.step,
        "peer_ranks": len(peers),
        "local_ranks": world - len(peers),
        "max_sends_per_rank": max(sends),
        "inventory_pickled_bytes": sum(sizes),
        "inventory_max_object_bytes": max(sizes),
        "inventory_to_rank0_bytes": sum(sizes) + 8 * (world - 1),  # each rank: its length, its record
        "gather_object_wire_bytes": world * max(sizes),  # padded to the largest object
        "gather_object_size_allgather_bytes": world * world * 8,  # every rank receives W int64 sizes
        "plan_scatter_wire_bytes": world * max(plan_sizes),
        "plan_pickled_bytes": sum(plan_sizes),
    }


def placement_cost(world: int, rpn: int, sample: int = 32) -> dict[str, Any]:
    """What the Checkpointer constructor's rank 0 spends placing every rank's replica
    (``replica_targets`` for all W ranks), timed on a sample and scaled to W."""
    from incluster.topology import Topology, replica_targets

    topo = Topology.from_nodes([f"node{r // rpn:05d}" for r in range(world)])
    ranks = list(range(0, world, max(1, world // sample)))[:sample]
    t0 = time.perf_counter()
    for r in ranks:
        replica_targets(topo, r, 1)
    per = (time.perf_counter() - t0) / len(ranks)
    return {"world": world, "sampled_ranks": len(ranks), "per_rank_s": per, "all_ranks_estimate_s": per * world}
