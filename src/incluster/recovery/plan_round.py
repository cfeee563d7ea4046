"""One planning round of a restore, and the resharding maps every rank gets from it.

Rank 0 plans from every node's inventory (:mod:`incluster.recovery.plan`), asks the
persistent tier whether it holds a newer step (:mod:`incluster.recovery.from_persistent`)
and scatters each rank only its own instructions; a failure every rank must hear travels
as a message instead of a plan.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from incluster.errors import CheckpointError, TierUnavailableError
from incluster.recovery import lineage
from incluster.recovery.from_persistent import persistent_plan, tier_manifests
from incluster.recovery.gather import active_dist as _dist, device_for_collectives, scatter_from_zero
from incluster.recovery.node import FOLDER
from incluster.recovery.plan import Plan, RankPlan, index_holders, make_plan, nodes_of
from incluster.recovery.reshard_pieces import Maps
from incluster.tier_layout import set_aside_reason
from incluster.topology import Topology

if TYPE_CHECKING:
    from incluster.recovery.restore import Context

log = logging.getLogger("incluster")
TIER = "<tier>"  # a plan's failure that is the persistent tier's, raised as TierUnavailableError
MESH = "<mesh>"  # an exclusion that asks rank 0 for a resharding plan at the same world size


def maps_of(ctx: Context, old_world: int, shared: dict[str, Any]) -> Maps:
    """Every rank gets rank 0's resharding plan: the server of each old shard and the node
    of each rank (one broadcast of O(W) integers)."""
    dist = _dist()
    vals = shared.get("maps")
    if dist is not None:
        t = torch.zeros(old_world + ctx.world_size, dtype=torch.int64, device=device_for_collectives())
        if ctx.rank == 0:
            t.copy_(torch.tensor(vals, dtype=torch.int64))
        dist.broadcast(t, 0)
        vals = t.cpu().tolist()
    server_of, node_of = vals[:old_world], vals[old_world:]  # type: ignore[index]
    if len(server_of) != old_world or not all(0 <= s < ctx.world_size for s in server_of):
        raise CheckpointError("rank 0 sent a resharding plan this rank cannot read; please report this")
    return Maps(server_of, node_of)


def plan_round(
    ctx: Context, gathered: list[Any] | None, exclude: set[tuple[str, int, int]], extra: list[Any] = (),  # type: ignore[assignment]
    shared: dict[str, Any] | None = None,
) -> RankPlan | str:
    """Rank 0 plans from every node's inventory (plus copies healed in earlier rounds) and
    scatters each rank only its own instructions (a resharding plan's shared part is left
    in ``shared`` for :func:`maps_of`)."""
    dist = _dist()
    plans: list[Any] | None = None
    if gathered is not None:
        topo = Topology.from_nodes([g[0] for g in gathered])
        held: dict[str, dict[tuple[int, ...], None]] = {}
        saved_here: set[tuple[str, int]] = set()  # (node, rank): the node's RAM holds the rank's slot files
        # Several ranks may list the same RAM folder (simulated nodes): each copy counted once.
        # Listings of one node name from different folders (pods with their own RAM) add up.
        for node, inv in gathered:
            if inv is not None:
                items = [tuple(int(x) for x in item) for item in inv]
                saved_here.update((node, i[0]) for i in items if i[1] == FOLDER)
                held.setdefault(node, {}).update((i, None) for i in items if i[1] != FOLDER)
        raw = {node: list(items) for node, items in held.items()}
        healed = [(node, [tuple(int(x) for x in item) for item in inv]) for node, inv in extra]
        remesh = any(e[0] == MESH for e in exclude)

        def planned(others: list[Any]) -> tuple[Plan, list[tuple[str, int, int]], dict[int, Any], Any]:
            # Copies of abandoned timelines, and of older timelines at a step a later one
            # saved again, are never combined with the rest (recovery/lineage.py).
            holdings, dropped, latest = lineage.current(raw, others)
            if ctx.only_step is not None:  # load(step=N): the other steps are evidence only (above)
                holdings = {node: [i for i in items if i[1] == ctx.only_step] for node, items in holdings.items()}
            for node, items in healed:  # copies healed in earlier rounds: of a step the plan chose
                holdings.setdefault(node, []).extend(items)
            return make_plan(topo, holdings, exclude, force_reshard=remesh), dropped, latest, holdings

        failed, persisted = None, None
        try:
            plan, dropped, lineages, holdings = planned([])
            manifests = tier_manifests(ctx, plan.step, exclude)
            if manifests:  # the tier's timelines are evidence too (its steps may be all a later one left)
                again = planned([(step, m[2]) for step, m in manifests.items()])
                if set(again[1]) != set(dropped):
                    plan = again[0]
                dropped, lineages, holdings = again[1], again[2], again[3]
            _say_dropped(ctx, dropped)
            holders = index_holders(holdings, topo, exclude)

            def own(step: int) -> set[int]:  # ranks whose own node holds a usable copy of their shard
                return {r for r, n in enumerate(topo.node_of) if n in nodes_of(holders, r, step, ctx.world_size)}

            if ctx.only_step is not None:
                manifests = {k: v for k, v in manifests.items() if k == ctx.only_step}
            persisted = persistent_plan(ctx, plan.step, manifests, exclude, shared,
                                        [topo.node_index(n) for n in topo.node_of], remesh=remesh, latest=lineages,
                                        own=own)
        except CheckpointError as exc:  # every rank must hear it, not wait in the scatter
            plan, failed = Plan(None, []), (TIER if isinstance(exc, TierUnavailableError) else "") + str(exc)
        if failed is not None:
            plans = [failed] * ctx.world_size
        elif persisted is not None:
            plans = persisted
        elif plan.step is None and ctx.only_step is not None:
            want = ctx.only_step
            aside = set_aside_reason(ctx.persistent, ctx.job, want) if ctx.persistent is not None else None
            why = (f": it lacks rank(s) {plan.missing[want]}" if want in plan.missing
                   else f": the tier's copy is set aside ({aside})" if aside is not None
                   else ": copies of it failed verification (see the log)" if any(e[2] == want for e in exclude)
                   else " (of the timeline restores take now)")
            plans = [f"load(step={want}): no good copy of every rank's shard of step {want} is in the cluster's RAM"
                     + ("" if ctx.persistent is None else " or the persistent tier") + why
                     + "; nothing is loaded. `incluster ls` lists the steps there are"] * ctx.world_size
        elif plan.step is None and exclude:
            # Copies existed but none could be used: starting afresh would silently drop them.
            bad = sorted({step for _, _, step in exclude})
            lacking = ""
            if plan.missing:
                newest = max(plan.missing)
                lacking = f"; step {newest} now lacks rank(s) {plan.missing[newest]}"
            msg = (
                f"no step has a good copy of every rank's shard: copies of step(s) {bad} failed verification or do "
                f"not fit this job (see the log for each copy and why){lacking}; nothing is loaded. `incluster ls` "
                f"and `incluster verify` show what there is. To start afresh, name a new job (job=...); the copies "
                f"in {os.path.join(ctx.local_dir, ctx.job)} on each node"
                + ("" if ctx.persistent is None else f" and in the persistent tier's {ctx.job}/ folder")
                + " stay until you remove them"
            )
            plans = [msg] * ctx.world_size
        elif plan.step is None and plan.missing and _never_committed(plan, topo, saved_here, raw):
            # A crash in the job's first save: no step was ever durable (the ranks it lacks have
            # their folders, with their slots, on their nodes: their RAM was not lost). It was
            # raised as lost shards at every restart, so the job could never start again.
            log.warning("incluster: no step of job %r was ever complete: step(s) %s lack the shards of ranks whose "
                        "nodes still hold their folders (saves in flight at a crash, never durable); starting "
                        "afresh", ctx.job, sorted(plan.missing))
            plans = [RankPlan(None, afresh=True) for _ in range(ctx.world_size)]
        elif plan.step is None and plan.missing:
            newest = max(plan.missing)
            old = plan.missing_world.get(newest)
            whose = f"rank(s) {plan.missing[newest]}" if old is None else (
                f"the shard(s) of rank(s) {plan.missing[newest]} of the {old} ranks that saved it")
            msg = (
                f"no step has a copy of every rank's shard on the current nodes: step {newest} lacks "
                f"{whose}; older steps lack others"
                + ("" if ctx.persistent is None else ", and the persistent tier has no complete step")
                + f". A restart on the nodes that hold the missing shards restores it; a persistent tier "
                f"(persistent=...) survives such losses. To start afresh, name a new job (job=...); the copies in "
                f"{os.path.join(ctx.local_dir, ctx.job)} on each node stay until you remove them"
            )
            plans = [msg] * ctx.world_size
        else:
            chosen = lineages.get(plan.step) if plan.step is not None else None
            plans = [dataclasses.replace(p, lineage=chosen) for p in plan.ranks]
            if plan.world is not None and (plan.world != ctx.world_size or remesh) and shared is not None:
                shared["maps"] = list(plan.server_of) + [topo.node_index(n) for n in topo.node_of]
    if dist is None:
        return plans[0] if plans else RankPlan(None)
    wire = None if plans is None else [p if isinstance(p, str) else dataclasses.asdict(p) for p in plans]
    got = scatter_from_zero(wire, ctx.rank, ctx.world_size)  # JSON, never pickle
    if isinstance(got, str):
        return got
    try:
        mine = RankPlan(**got)
    except TypeError as exc:
        raise CheckpointError(f"rank 0 sent a restore plan this rank cannot read ({exc}); are all ranks "
                              f"running the same incluster version?") from None
    return dataclasses.replace(mine, sends=tuple(int(r) for r in mine.sends),
                               lineage=None if mine.lineage is None else lineage.parse(list(mine.lineage)))


_told: set[tuple[str, int, int]] = set()


def _say_dropped(ctx: Context, dropped: list[tuple[str, int, int]]) -> None:
    """Rank 0, once per process and copy: the copies a restore passes over, and why."""
    new = [d for d in dropped if (ctx.job, d[1], d[2]) not in _told]
    if not new:
        return
    _told.update((ctx.job, d[1], d[2]) for d in new)
    steps = sorted({d[2] for d in new})
    nodes = sorted({d[0] for d in new})
    log.warning("incluster: copies of step(s) %s on node(s) %s belong to a timeline a later restore left (it went "
                "back past them, or saved the same step again): not used, never mixed with the later timeline's",
                steps, nodes)


def _never_committed(plan: Any, topo: Any, saved_here: set[tuple[str, int]], raw: dict[str, list[Any]]) -> bool:
    """Whether no step was ever complete: every step the cluster holds was saved by this
    world and lacks only ranks whose own node lists their folder as holding an earlier
    run's slot files and no commit record (a node lost, replaced or moved to does not);
    no copy records a restore (lineage base >= 0: some step was complete then), and none
    is a record without its bytes (a bad copy set aside, a shared replica)."""
    items = [i for held in raw.values() for i in held]
    if any(i[2] < 0 or (len(i) >= 8 and i[7] >= 0) for i in items):
        return False
    return all(step not in plan.missing_world and
               all((topo.node_of[r], r) in saved_here for r in lacking)
               for step, lacking in plan.missing.items())
