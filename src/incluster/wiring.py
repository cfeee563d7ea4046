"""How a Checkpointer is wired into its job, at start and at close.

- ``start_store``: rank 0 learns every rank's node, places replicas, hosts the job store,
  and sends each rank its store address and replica partners (one gather, one scatter);
- ``release_store``: every rank checks out; rank 0 keeps the store up until all have
  (bounded), so no rank loses it while it still waits for an outcome;
- ``persistent_tier`` / ``persist_params``: the persistent tier for restores, and the
  picklable parameters that take it into the writer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from incluster.commit import StoreAddress, host_store
from incluster.config import Config
from incluster.persist import PersistParams

log = logging.getLogger("incluster")


Started = tuple[object, StoreAddress | None, tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]


def start_store(config: Config, rank: int, world_size: int, asked: bool = True) -> Started:
    """(store server or None, its address, my replica targets, my replica sources, and - on
    each node's lowest rank - the ranks whose folders belong on this node: its ranks' own
    and the replicas they keep; ``writer/sweep.py`` removes the others). ``asked``: the user
    passed replicas (a default that the nodes cannot hold is said at INFO, not as a warning)."""
    if world_size == 1:
        return None, None, (), (), (0,)
    from incluster.topology import Topology, replica_targets

    from incluster.recovery.gather import gather_to_zero, scatter_from_zero

    nodes = gather_to_zero(config.node, rank, world_size)  # O(W) bytes in all
    server, plans = None, None
    if nodes is not None:
        topo = Topology.from_nodes(nodes)
        replicas = topo.effective_replicas(config.replicas)
        if replicas < config.replicas:  # a default the user never chose is news, not a warning
            log.log(logging.WARNING if asked else logging.INFO,
                    "incluster: %s, but the job spans %d node(s): keeping %d (a replica never lives on its "
                    "owner's node)", f"{config.replicas} replica(s) asked for" if asked else
                    f"replicas={config.replicas} (the default)", len(topo.nodes), replicas)
        server, address = host_store(config.job, world_size, 1 + replicas)
        sources: dict[int, list[int]] = {r: [] for r in range(world_size)}
        targets = {r: tuple(replica_targets(topo, r, replicas)) for r in range(world_size)}
        for r, ts in targets.items():
            for t in ts:
                sources[t].append(r)
        kept: dict[int, list[int] | None] = {r: None for r in range(world_size)}
        for node in topo.nodes:
            on = topo.ranks_on(node)
            kept[min(on)] = sorted({*on, *(s for r in on for s in sources[r])})
        plans = [[dataclasses.asdict(address), list(targets[r]), sorted(sources[r]), kept[r]] for r in range(world_size)]
    mine = scatter_from_zero(plans, rank, world_size)  # JSON, never pickle
    address = StoreAddress(**mine[0])
    kept_here = None if mine[3] is None else tuple(int(r) for r in mine[3])
    return server, address, tuple(int(t) for t in mine[1]), tuple(int(s) for s in mine[2]), kept_here


def closed_key(job: str) -> str:
    """The job store's count of ranks that checked out (close(), or an exit with nothing in flight)."""
    return f"incluster/{job}/closed"


def release_store(server: Any, address: StoreAddress | None, config: Config, rank: int, world_size: int,
                  last: tuple[int, int], how: int | None = None) -> None:
    """Check out of the job store (rank 0: and keep it up, bounded, until every rank did).
    ``last``: this rank's timeline and last save() step, marked first as the end of its
    saves (writer/sequence.py ``leave``), so no rank waits ``slot_timeout_s`` for a step
    this one never saves. The writer marks its own last step too, once it saw a save (the
    same step, unless the others skipped this rank's last one: a key nobody else reads).
    ``how``: how the rank left (writer/sequence.py CLOSED, the default, or EXITED: an exit
    without close(), ``launch.check_out_at_exit``)."""
    if address is None:
        return
    from incluster.commit import StoreCoordinator
    from incluster.writer.sequence import CLOSED, leave

    key = closed_key(config.job)
    coord = None
    try:
        coord = StoreCoordinator(address, rank, timeout=10)
        leave(coord.successor, coord.at(last[0]).failed, rank, last[0], last[1], CLOSED if how is None else how)
    except Exception as exc:  # noqa: BLE001 - the others then time out on such a step instead
        log.info("incluster: rank %d could not mark its last save in the job store: %s", rank, exc)
        if coord is None and rank != 0:  # no store to check out of either (a second try: 10 s more)
            return
    try:
        if rank != 0:
            (coord or StoreCoordinator(address, rank, timeout=10)).store.add(key, 1)
            return
        server.add(key, 1)
        deadline = time.monotonic() + config.slot_timeout_s
        while server.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001 - closing must not raise for a peer's sake
        log.warning("incluster: rank %d could not check out of the job store: %s", rank, exc)


def persistent_tier(config: Config) -> Any:
    if not config.persistent:
        return None
    from incluster.tiers.persistent import open_tier

    return open_tier(config.persistent, config.persistent_options)


def persist_params(config: Config, rank: int, world_size: int, run: str) -> PersistParams | None:
    """``run``: rank 0's process's run id, the same on every rank (``StoreAddress.run``)."""
    c = config
    if not c.persistent:
        return None
    from incluster.tiers.persistent import open_tier

    tier = open_tier(c.persistent, c.persistent_options)  # fail here, clearly, if it cannot be reached
    if hasattr(tier, "check_writable"):
        tier.check_writable()
    if getattr(tier, "process_local", False) and (c.writer == "process" or world_size > 1):
        who = ("the writer process uploads, so every upload would go into the writer's own memory and be "
               "lost with it" if c.writer == "process" else
               f"each of the {world_size} ranks is a process of its own, so no rank would see another's shards")
        raise ValueError(
            f"persistent={c.persistent!r} is a filesystem in one process's memory: {who}. Use a path or an "
            f"object store URL" + (", or writer='thread' in a one-process job" if world_size == 1 else ""))
    if c.writer == "process" and not isinstance(c.persistent, str):
        import pickle

        try:
            pickle.dumps(c.persistent)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means the same
            raise ValueError(
                f"persistent={c.persistent!r} must be picklable to reach the writer process ({exc}); "
                f"pass a path or URL, or use writer='thread'"
            ) from None
    return PersistParams(
        url=c.persistent, options=dict(c.persistent_options or {}), job=c.job, rank=rank,
        world_size=world_size, every=c.persistent_every, interval_s=c.persistent_interval_s,
        keep=c.persistent_keep, timeout_s=c.slot_timeout_s, run=run, trainer_pid=os.getpid(),
    )
