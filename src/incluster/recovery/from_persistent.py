"""Restoring from the persistent tier (tier 2) when it holds a newer step than the cluster.

Rank 0 compares the newest manifested persistent step with the newest complete
in-cluster step; if the persistent one is newer, every rank downloads its own shard
(verified against its sidecar and the manifest) into one of its slots, which heals its
node's RAM tier on the way.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from incluster.errors import CorruptCheckpointError
from incluster.recovery.plan import RankPlan

log = logging.getLogger("incluster")


def persistent_plan(ctx: Any, in_cluster: int | None, exclude: set[tuple[str, int, int]]) -> list[RankPlan] | None:
    """Rank 0: plans to restore from tier 2 when its newest manifested step is newer than
    the newest complete in-cluster step (a tie prefers the cluster's RAM)."""
    if ctx.persistent is None:
        return None
    from incluster.persist import MANIFEST, manifested_steps, step_dir

    for step in manifested_steps(ctx.persistent, ctx.job):
        if in_cluster is not None and step <= in_cluster:
            return None
        if ("<persistent>", -1, step) in exclude:
            continue
        try:
            manifest = json.loads(ctx.persistent.read(f"{step_dir(ctx.job, step)}/{MANIFEST}"))
            records = {int(r["rank"]): r for r in manifest["ranks"]}
            if int(manifest["world_size"]) != ctx.world_size or sorted(records) != list(range(ctx.world_size)):
                log.warning("incluster: persistent step %d was saved by %s ranks; this job has %d",
                            step, manifest.get("world_size"), ctx.world_size)
                exclude.add(("<persistent>", -1, step))
                continue
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.warning("incluster: persistent step %d has an unreadable manifest (%s); skipped", step, exc)
            exclude.add(("<persistent>", -1, step))
            continue
        return [RankPlan(step, None, (), "persistent", records[r]) for r in range(ctx.world_size)]
    return None


def download(ctx: Any, step: int, record: dict) -> str | None:  # type: ignore[type-arg]
    """Fetch my shard of ``step`` from tier 2 into one of my slots, verify, commit (heal)."""
    from incluster.format.checksum import Checksum
    from incluster.persist import step_dir
    from incluster.writer.local_commit import commit_received, parse_received_sidecar

    base = f"{step_dir(ctx.job, step)}/rank-{ctx.rank:05d}"
    where = f"rank {ctx.rank}'s shard of persistent step {step}"
    try:
        expect = Checksum.from_json(record["checksum"], where)
        sc = parse_received_sidecar(
            ctx.persistent.read(base + ".json"), where, rank=ctx.rank, step=step, job=ctx.job, size=int(record["size"])
        )
        if sc.checksum != expect:
            return f"{where}: sidecar and manifest disagree"
        if any(s.step == step for s in ctx.ring.slots):
            # This node kept its own copy of a step the cluster as a whole lost (its save
            # failed elsewhere): the manifested copy replaces it.
            ctx.ring.discard(step)
        slot = ctx.ring.acquire(step, ctx.timeout_s)
        try:
            ctx.ring.prepare(slot, expect.size)
            into = memoryview(slot.mm) if slot.mm is not None else memoryview(bytearray())
            got = ctx.persistent.read(base + ".safetensors", into=into)
            if got != expect.size:
                raise CorruptCheckpointError(f"{where}: {got} bytes downloaded, the manifest says {expect.size}")
            commit_received(ctx.ring, slot, sc, where, node=ctx.node, restored_from="persistent")
        except BaseException:
            ctx.ring.release(slot)
            raise
    except (OSError, ValueError, KeyError, CorruptCheckpointError) as exc:
        return f"{where}: {exc}"
    return None
