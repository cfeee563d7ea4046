"""The restore, the same decision on every rank: inventory -> plan -> verify -> transfer.

1. inventory: one rank per node lists the (owner, step) shards its RAM folder holds
   (file names only); with the node names this is gathered to rank 0: O(W) in all;
2. plan (rank 0, pure, :mod:`incluster.recovery.plan`): the newest step with a copy of
   every rank's shard, and who reads locally / receives from whom; each rank gets only
   its own instructions (scatter);
3. verify: each rank checks every copy it will read or send (checksums); bad copies are
   reported, un-committed, and rank 0 plans again without them;
4. transfer (:mod:`incluster.recovery.transfer`): P2P on the default group, verified on
   arrival and written into the receiver's own slot (healing its node's tier);
5. load in place; the caller re-sends replicas in the background.

Never a torn state: a rank loads only after every rank has a verified copy of the step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from incluster.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from incluster.recovery.plan import RankPlan, make_plan
from incluster.recovery.transfer import Outgoing, exchange
from incluster.staging.slots import SlotRing, sidecar_file, step_file
from incluster.state import load_into
from incluster.testing import faults
from incluster.tiers.local import ShardReader, committed_steps, rank_folder
from incluster.topology import Topology

log = logging.getLogger("incluster")
MAX_ROUNDS = 4


@dataclass
class RestoreReport:
    """One rank's restore decision: what, from where, how much, how long."""

    rank: int
    node: str
    step: int | None
    source: str = "none"  # "local", "peer" or "none"
    source_rank: int | None = None
    source_node: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    rounds: int = 0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        if self.step is None:
            return f"incluster restore: rank {self.rank} on {self.node}: nothing to restore"
        src = "its own node's RAM" if self.source == "local" else f"rank {self.source_rank} on node {self.source_node}"
        extra = f"; {'; '.join(self.notes)}" if self.notes else ""
        return (
            f"incluster restore: rank {self.rank} on {self.node}: step {self.step} from {src}, "
            f"{self.bytes} bytes in {self.seconds:.3f} s{extra}"
        )


def node_inventory(local_dir: str, job: str) -> list[tuple[int, int, int]]:
    """(owner rank, step, bytes) for every committed shard in this node's folder (names
    and sizes only; nothing is read)."""
    base = os.path.join(local_dir, job)
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.startswith("rank-") and n[5:].isdigit():
            folder = os.path.join(base, n)
            for step in committed_steps(folder):
                try:
                    out.append((int(n[5:]), step, os.stat(os.path.join(folder, step_file(step))).st_size))
                except FileNotFoundError:
                    continue  # a sidecar without its shard: not a copy
    return out


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


@dataclass
class Context:
    local_dir: str
    job: str
    rank: int
    world_size: int
    node: str
    ring: SlotRing
    allow_pickle: bool
    timeout_s: float
    persistent: Any = None  # a FsspecTier, or None


def restore(ctx: Context, state: Mapping[str, Any]) -> RestoreReport:
    t0 = time.perf_counter()
    report = RestoreReport(ctx.rank, ctx.node, None)
    dist = _dist()
    inventory = node_inventory(ctx.local_dir, ctx.job)
    gathered: list[Any] | None = None
    if dist is not None:
        gathered = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object((ctx.node, inventory if _reports_for_node() else None), gathered, dst=0)
    else:
        gathered = [(ctx.node, inventory)]
    exclude: set[tuple[str, int, int]] = set()
    for round_ in range(1, MAX_ROUNDS + 1):
        report.rounds = round_
        mine = _plan_round(ctx, gathered, exclude)
        if isinstance(mine, str):
            raise NoCheckpointError(mine)
        if mine.step is None:
            report.seconds = time.perf_counter() - t0
            return report
        ctx.ring.reset_to(mine.step)
        _abandon_newer(ctx.local_dir, ctx.job, mine.step)
        if mine.persistent is not None:
            problem = _download(ctx, mine.step, mine.persistent)
            if problem is not None:
                log.warning("incluster: %s; the persistent step is set aside", problem)
                report.notes.append(problem)
            if _collect_bad(ctx, [("<persistent>", -1, mine.step)] if problem else [], exclude):
                continue
            _load(ctx, mine, mine.step, state, report)
            report.source = "persistent"
            report.seconds = time.perf_counter() - t0
            return report
        slot = None
        if mine.source is not None and mine.size is not None:
            # Allocate the receiving slot now, while the senders verify their copies.
            slot = ctx.ring.acquire(mine.step, ctx.timeout_s)
            ctx.ring.prepare(slot, mine.size)
        bad, outgoing, own = _verify_copies(ctx, mine, mine.step, report)
        if _collect_bad(ctx, bad, exclude):
            for o in outgoing:
                o.reader.close()
            if own is not None:
                own.close()
            if slot is not None:
                ctx.ring.release(slot)
            continue
        problem, received = None, None
        try:
            faults.check("load-transfer", ctx.rank, mine.step)
            if dist is not None:
                problem, received = exchange(
                    ctx.rank, mine.step, mine.source, outgoing, ctx.ring,
                    job=ctx.job, node=ctx.node, timeout_s=ctx.timeout_s, slot=slot,
                )
        finally:
            for o in outgoing:
                o.reader.close()
        if problem is not None:
            report.notes.append(f"copy from rank {mine.source} rejected: {problem}")
        if _collect_bad(ctx, [(str(mine.source_node), ctx.rank, mine.step)] if problem else [], exclude):
            if own is not None:
                own.close()
            continue
        if received is not None:
            own = ShardReader.over(*received)
        _load(ctx, mine, mine.step, state, report, own)
        report.seconds = time.perf_counter() - t0
        return report
    raise CheckpointError(f"restore did not settle after {MAX_ROUNDS} rounds of re-planning; see the log for bad copies")


def _abandon_newer(local_dir: str, job: str, step: int) -> None:
    """Training continues from ``step``: every copy of a newer step on this node (own
    shards and replicas alike) belongs to an abandoned timeline. Un-commit them all, so
    a later restore can never mix an old-timeline copy with a new one of the same step,
    and replication never declines a new step because a stale copy has its name."""
    base = os.path.join(local_dir, job)
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return
    for n in names:
        if not (n.startswith("rank-") and n[5:].isdigit()):
            continue
        folder = os.path.join(base, n)
        for newer in committed_steps(folder):
            if newer > step:
                for name in (sidecar_file(newer), step_file(newer)):  # the marker first
                    try:
                        os.unlink(os.path.join(folder, name))
                    except FileNotFoundError:
                        pass


def _reports_for_node() -> bool:
    # One inventory per node is enough; torchrun's LOCAL_RANK says who reports.
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _plan_round(ctx: Context, gathered: list[Any] | None, exclude: set[tuple[str, int, int]]) -> RankPlan | str:
    dist = _dist()
    plans: list[Any] | None = None
    if gathered is not None:
        topo = Topology.from_nodes([g[0] for g in gathered])
        holdings: dict[str, list[tuple[int, ...]]] = {}
        for node, inv in gathered:
            if inv is not None:
                holdings.setdefault(node, []).extend(tuple(int(x) for x in item) for item in inv)
        plan = make_plan(topo, holdings, exclude)
        persisted = _persistent_plan(ctx, plan.step, exclude)
        if persisted is not None:
            plans = persisted
        elif plan.step is None and plan.missing:
            newest = max(plan.missing)
            msg = (
                f"no step has a copy of every rank's shard on the current nodes: step {newest} lacks "
                f"rank(s) {plan.missing[newest]}; older steps lack others"
                + ("" if ctx.persistent is None else ", and the persistent tier has no complete step")
                + f". Configure a persistent tier (persistent=...) to survive this, or delete "
                f"{os.path.join(ctx.local_dir, ctx.job)} on every node to start afresh"
            )
            plans = [msg] * ctx.world_size
        else:
            plans = list(plan.ranks)
    if dist is None:
        return plans[0] if plans else RankPlan(None)
    box: list[Any] = [None]
    dist.scatter_object_list(box, plans, src=0)
    return box[0]


def _persistent_plan(ctx: Context, in_cluster: int | None, exclude: set[tuple[str, int, int]]) -> list[RankPlan] | None:
    """Rank 0: plans to restore from tier 2 when its newest manifested step is newer than
    the newest complete in-cluster step (a tie prefers the cluster's RAM)."""
    if ctx.persistent is None:
        return None
    import json

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
                continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("incluster: persistent step %d has an unreadable manifest (%s); skipped", step, exc)
            continue
        return [RankPlan(step, None, (), "persistent", records[r]) for r in range(ctx.world_size)]
    return None


def _download(ctx: Context, step: int, record: dict) -> str | None:  # type: ignore[type-arg]
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


def _verify_copies(
    ctx: Context, mine: RankPlan, step: int, report: RestoreReport
) -> tuple[list[tuple[str, int, int]], list[Outgoing], ShardReader | None]:
    """Check every copy this rank will read or send; un-commit the bad ones. My own
    verified copy stays open for the load (verified once, mapped once)."""
    bad: list[tuple[str, int, int]] = []
    outgoing: list[Outgoing] = []
    own: ShardReader | None = None
    needed = ([ctx.rank] if mine.source is None else []) + list(mine.sends)
    for owner in needed:
        folder = rank_folder(ctx.local_dir, ctx.job, owner)
        try:
            reader = ShardReader(folder, step)
            sc = reader.sidecar
            if sc.rank != owner or sc.job != ctx.job:
                reader.close()
                raise CorruptCheckpointError(f"{folder}: step {step} claims rank {sc.rank} of job {sc.job!r}")
        except CorruptCheckpointError as exc:
            log.warning("incluster: rank %d: the copy of rank %d's step %d on node %s is bad (%s); "
                        "it is set aside and another copy is used", ctx.rank, owner, step, ctx.node, exc)
            report.notes.append(f"rank {owner}'s copy on {ctx.node} failed verification ({exc})")
            if owner == ctx.rank:
                ctx.ring.discard(step)  # my own slot: the ring must forget it too
            else:
                _uncommit(folder, step)
            bad.append((ctx.node, owner, step))
            continue
        if owner == ctx.rank:
            own = reader
        else:
            with open(os.path.join(folder, sidecar_file(step)), "rb") as f:
                outgoing.append(Outgoing(owner, f.read(), reader))
    return bad, outgoing, own


def _uncommit(folder: str, step: int) -> None:
    try:
        os.unlink(os.path.join(folder, sidecar_file(step)))
    except FileNotFoundError:
        pass


def _collect_bad(ctx: Context, bad: list[tuple[str, int, int]], exclude: set[tuple[str, int, int]]) -> bool:
    """Share every rank's bad copies with rank 0; True if anyone found one (re-plan)."""
    dist = _dist()
    if dist is None:
        exclude.update(bad)
        return bool(bad)
    all_bad: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(bad, all_bad, dst=0)
    flag = torch.tensor([0], dtype=torch.int64)
    if all_bad is not None:
        for b in all_bad:
            exclude.update(tuple(x) for x in b)  # type: ignore[misc]
        flag[0] = sum(len(b) for b in all_bad)
    box = [int(flag[0])]
    dist.broadcast_object_list(box, src=0)
    return box[0] > 0


def _load(ctx: Context, mine: RankPlan, step: int, state: Mapping[str, Any], report: RestoreReport,
          reader: ShardReader | None = None) -> None:
    """Copy the (already verified) shard into the live state."""
    folder = rank_folder(ctx.local_dir, ctx.job, ctx.rank)
    with reader if reader is not None else ShardReader(folder, step) as reader:
        sc = reader.sidecar
        if sc.world_size != ctx.world_size:
            raise CheckpointError(
                f"step {step} was saved by {sc.world_size} ranks but this job has {ctx.world_size}; "
                f"resharding in place is not supported - assemble a full state with `incluster export`"
            )
        load_into(state, sc.tree, reader.tensor, allow_pickle=ctx.allow_pickle)
        report.step, report.bytes = step, reader.nbytes
    report.source = "local" if mine.source is None else "peer"
    report.source_rank = mine.source
    report.source_node = mine.source_node
    ctx.ring.set_global(step)
