"""The restore, the same decision on every rank: inventory -> plan -> transfer -> load.

1. inventory: one rank per node lists the (owner, step) shards its RAM folder holds
   (file names only); with the node names this is sent to rank 0 point to point
   (:mod:`incluster.recovery.gather`): O(W) bytes in all;
2. plan (rank 0, pure, :mod:`incluster.recovery.plan`): the newest step with a copy of
   every rank's shard, and who reads locally / receives from whom; each rank gets only
   its own instructions (scatter);
3. transfer (:mod:`incluster.recovery.transfer`): P2P on the default group; the receiver
   lands the bytes in its live tensors, checks every chunk as it lands and writes them
   into its own slot (healing its node's tier), committed only if every chunk matched;
4. local load (:mod:`incluster.recovery.landing`): a rank whose node holds its shard
   reads it straight into its live tensors, every chunk checked while in the cache;
5. every rank reports its bad copies to rank 0; if there are any, rank 0 plans again
   without them and every rank whose step changed, or whose copy was bad, loads again.
   The caller then re-sends replicas in the background.

Never a torn state returned: ``restore`` returns only after every rank loaded the same
step from fully verified bytes. Bytes of a bad copy may land in the live tensors before
its bad chunk is found; they are always overwritten by the next round's load, and if no
round succeeds the error says the state was partly overwritten.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from incluster.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, TierUnavailableError
from incluster.format.checksum import core_share, verify
from incluster.recovery.equivalent import SIDECAR_BAD
from incluster.recovery.forward import forward_sidecars
from incluster.recovery.from_persistent import Problem, download, fetch_old_shards, set_aside
from incluster.recovery.gather import active_dist as _dist, device_for_collectives, gather_to_zero
from incluster.recovery.landing import Landing, direct_targets, read_verified, segments
from incluster.recovery.node import (
    abandon_newer, bad_copy, drop_other_timelines, node_inventory, open_outgoing, uncommit,
)
from incluster.recovery.plan import RankPlan
from incluster.recovery.plan_round import MESH, TIER, maps_of, plan_round
from incluster.recovery.reshard import Reshard
from incluster.recovery.reshard_shard import mesh_changed
from incluster.recovery.transfer import Incoming, Outgoing, exchange
from incluster.staging.slots import SlotRing
from incluster.state_load import CANNOT_LOAD as _CANNOT_LOAD, load_into
from incluster.testing import faults
from incluster.tiers.local import open_shard, rank_folder

log = logging.getLogger("incluster")
MAX_ROUNDS = 6


@dataclass
class RestoreReport:
    """One rank's restore decision: what, from where, how much, how long."""

    rank: int
    node: str
    step: int | None
    source: str = "none"  # "local", "peer", "persistent", "reshard" or "none"
    source_rank: int | None = None
    source_node: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    rounds: int = 0
    old_world: int | None = None  # resharded: the world size that saved the step
    from_tier: bool = False  # resharded: the old shards came from the persistent tier first
    first_chosen: int | None = None  # the step the first round chose (newer than ``step``: it could not be restored)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        if self.step is None:
            return f"incluster restore: rank {self.rank} on {self.node}: nothing to restore"
        if self.source == "reshard":
            src = "the persistent tier, resharded" if self.from_tier else "the cluster's RAM, resharded"
        elif self.source == "local":
            src = "its own node's RAM"
        elif self.source == "persistent":
            src = "the persistent tier"
        else:
            src = f"rank {self.source_rank} on node {self.source_node}"
        extra = f"; {'; '.join(self.notes)}" if self.notes else ""
        return (
            f"incluster restore: rank {self.rank} on {self.node}: step {self.step} from {src}, "
            f"{self.bytes} bytes in {self.seconds:.3f} s{extra}"
        )


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
    rank_state: str = "same-rank"  # reshard_rank_state: a restore into another world size
    refuse_resize: str | None = None  # an integration's reason no step of another world size can go on
    left_out_ok: bool = False  # an integration leaves parts of the checkpoint out on purpose (load_into)
    heal: Any = None  # out: a received copy (transfer.Received) whose heal is left to the caller
    only_step: int | None = None  # load(step=N): this step or none (rank 0's decides)
    since: float = 0.0  # when this rank's Checkpointer was made (its own slot files are newer)


def restore(ctx: Context, state: Mapping[str, Any]) -> RestoreReport:
    t0 = time.perf_counter()
    report = RestoreReport(ctx.rank, ctx.node, None)
    run = _Run(ctx, state, report)
    # Optimizers that have not stepped get state for the load (state_load.init_lazy_optimizers):
    # a load refused before any byte landed leaves them without it again, as they were
    fresh = [o for o in state.values() if isinstance(o, torch.optim.Optimizer) and not o.state] if isinstance(
        state, Mapping) else []
    try:
        run.go()
    except CheckpointError as exc:
        if run.received is not None:
            run.received.abandon()
        if not run.dirty and run.loaded is None:
            for o in fresh:
                o.state.clear()
        if run.dirty:  # never let a caller mistake a partly overwritten state for an untouched one
            raise CheckpointError(
                f"{str(exc).replace('; nothing is loaded', '')}. The live state was already partly overwritten "
                f"by this restore (bytes of a copy "
                f"that landed before this error, or of one that failed verification): rebuild it before "
                f"training"
            ) from exc
        raise
    except BaseException:
        if run.received is not None:
            run.received.abandon()
        raise
    report.seconds = time.perf_counter() - t0
    return report


def _verify_whole(fd: int, sc: Any, path: str) -> None:
    """:class:`CorruptCheckpointError` unless the shard at ``fd`` matches its record."""
    size = os.fstat(fd).st_size
    if not size:
        return
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        verify(mm, sc.checksum, path)
    finally:
        mm.close()


class _Run:
    """One restore on one rank: rounds of plan -> open copies -> transfer -> load, until
    every rank has loaded the same step from verified bytes."""

    def __init__(self, ctx: Context, state: Mapping[str, Any], report: RestoreReport) -> None:
        self.ctx, self.state, self.report = ctx, state, report
        self.loaded: int | None = None  # step whose verified bytes are all in the live state
        self.loaded_as: tuple[int, int, int] | None = None  # the lineage of those bytes (recovery/lineage.py)
        self.came_from: tuple[int, int, str | None] | None = None  # (step, rank, node) a peer sent it from
        self.dirty = False  # the live state holds bytes of a copy or step not (or no longer) chosen
        self.extra: list[tuple[str, list[tuple[int, ...]]]] = []  # rank 0: copies healed so far
        self.exclude: set[tuple[str, int, int]] = set()  # rank 0: bad copies
        self.origin: dict[tuple[str, int, int], str] = {}  # rank 0: rebuilt copy -> node of its sidecar
        self.received: Any = None  # a verified copy received from a peer, not yet healed
        self.problem: CheckpointError | None = None  # this rank cannot load the step: every rank stops

    def go(self) -> None:
        ctx, report = self.ctx, self.report
        dist = _dist()
        mine_inv = (ctx.node, node_inventory(ctx.local_dir, ctx.job, ctx.since) if _reports_for_node(ctx) else None)
        gathered = gather_to_zero(mine_inv, ctx.rank, ctx.world_size) if dist is not None else [mine_inv]
        for round_ in range(1, MAX_ROUNDS + 1):
            report.rounds = round_
            shared: dict[str, Any] = {}
            mine = plan_round(ctx, gathered, self.exclude, self.extra, shared)
            if isinstance(mine, str):
                if mine.startswith(TIER):  # not "nothing saved": a caller must not start afresh on it
                    raise TierUnavailableError(mine[len(TIER):])
                raise NoCheckpointError(mine)
            other = mine.lineage is not None and self.loaded_as is not None and tuple(mine.lineage) != self.loaded_as
            if self.loaded is not None and (mine.step != self.loaded or other):  # another step, or its namesake
                self.dirty, self.loaded = True, None
            if report.first_chosen is None:
                report.first_chosen = mine.step
            if mine.step is None:
                if self.dirty:  # every copy left was bad: "nothing saved" would start from a torn state
                    raise NoCheckpointError("no step is left with a good copy of every rank's shard")
                self._settle(mine)  # afresh: the never-complete copies go
                return
            if mine.forwarding:  # rebuild lost shards where identical bytes are, then plan again
                rebuilt, bad = forward_sidecars(ctx, mine)
                self._collect(bad, rebuilt, every=True)
                report.notes.extend(f"rank {h[1]}'s step {h[2]} rebuilt on {h[0]} from an identical shard" for h in rebuilt)
                continue
            if mine.world is not None and mine.world != ctx.world_size and ctx.refuse_resize:
                # An integration's refusal, in its words: the plan is every rank's, so all stop
                # here, before a byte lands or a tier shard is fetched (RAM and tier alike).
                from incluster.integrations.rng import resize_refusal

                raise CheckpointError(resize_refusal(mine.step, mine.world, ctx.world_size, ctx.refuse_resize, ctx.job))
            if mine.world is not None and mine.world != ctx.world_size and ctx.rank_state == "refuse":
                raise CheckpointError(  # the same on every rank, before a byte lands or a tier shard is fetched
                    f"step {mine.step} was saved by {mine.world} ranks and this job has {ctx.world_size}; "
                    f"reshard_rank_state='refuse' forbids restoring it here. Restart with {mine.world} ranks, or "
                    f"set reshard_rank_state to 'same-rank' or 'rank0'")
            if mine.world is not None and (mine.world != ctx.world_size or mine.reshard):
                self.dirty, self.loaded = self.dirty or self.loaded is not None, None
                report.from_tier = mine.persistent is not None
                if mine.persistent is not None:  # tier 2 first: each old shard into one node's RAM
                    problem = fetch_old_shards(ctx, mine.step, mine.persistent.get("reshard", []), mine.world)
                    report.notes.append("old shards fetched from the persistent tier")
                    if problem is not None:
                        log.warning("incluster: %s; the persistent step is %s", problem,
                                    "set aside" if problem.bad else "passed over in this restore")
                        report.notes.append(problem.text)
                        if problem.bad:
                            set_aside(ctx, mine.step, problem)
                    if self._collect([("<persistent>", -1, mine.step)] if problem else []):
                        continue
                rs = Reshard(ctx, self.state, mine.step, maps_of(ctx, mine.world, shared), report)
                try:
                    if rs.run(self._collect):
                        continue
                finally:
                    self.dirty = self.dirty or rs.dirty
                report.source, report.old_world = "reshard", mine.world
                self._settle(mine)
                return
            if mine.persistent is not None:
                if self.loaded != mine.step and not ctx.ring.room_for_restore(mine.step):
                    self._make_room(mine)  # every slot holds a newer step: the tier's step replaces them
                problem = None if self.loaded == mine.step else self._download(mine)
                if problem is not None:
                    log.warning("incluster: %s; the persistent step is %s", problem,
                                "set aside" if problem.bad else "passed over in this restore")
                    report.notes.append(problem.text)
                    if problem.bad:
                        set_aside(ctx, mine.step, problem)
                elif self.loaded != mine.step and self.problem is None:
                    found = self._load_local(mine)
                    if any(b[0] == MESH for b in found):  # the next plan reshards the same step
                        if self._collect(found):
                            continue
                    elif found:
                        # verified as it was downloaded: its record does not fit its bytes (the tier's copy)
                        problem = Problem("its downloaded copy failed verification", True)
                        set_aside(ctx, mine.step, problem)
                if self._collect([("<persistent>", -1, mine.step)] if problem else []):
                    continue
                report.source = "persistent"
                self._settle(mine)
                return
            bad, outgoing = open_outgoing(ctx, mine, report)
            if mine.transfers and self._collect(bad):  # no rank sends: nobody can have found a bad copy yet
                for o in outgoing:
                    o.reader.close()
                continue
            if mine.source is not None and self.loaded != mine.step and not ctx.ring.room_for_restore(mine.step):
                self._make_room(mine)  # every slot holds a newer step: make room for the node's copy
            bad, healed = self._transfer(mine, outgoing), []
            if mine.source is not None and self.loaded == mine.step:
                self.came_from = (mine.step, mine.source, mine.source_node)
            if mine.source is not None and self.loaded == mine.step and self.received is not None and self.received.can_heal:
                healed = [(ctx.node, ctx.rank, mine.step, report.bytes)]
            elif mine.source is None and self.loaded != mine.step:
                self.came_from = None  # the live state takes this node's own copy now
                bad += self._load_local(mine)
            if self._collect(bad, healed):
                self._heal_now()  # rank 0 now counts my node's copy: it must exist before the next round
                continue
            source, source_node = mine.source, mine.source_node
            if source is None and self.came_from is not None and self.came_from[0] == self.loaded == mine.step:
                _, source, source_node = self.came_from  # received in an earlier round, healed, then planned as local
            report.source = "local" if source is None else "peer"
            report.source_rank, report.source_node = source, source_node or ctx.node
            self._settle(mine)
            ctx.heal, self.received = self.received, None
            return
        raise CheckpointError(f"restore did not settle after {MAX_ROUNDS} rounds of re-planning; see the log for bad copies")

    def _make_room(self, mine: RankPlan) -> None:
        """Every slot holds a step newer than ``mine.step``, which is to land in one. A
        rollback (``load(step=N)``) gives up only the oldest of them, so that one that then
        fails leaves the others loadable; a plain restore settles at once (its newer steps
        are not complete anywhere)."""
        if self.ctx.only_step is None or mine.step is None or not self.ctx.ring.room_beside_newer(mine.step):
            self._settle(mine)

    def _settle(self, mine: RankPlan) -> None:
        """Training goes on from ``mine.step``: newer steps on this node are an abandoned
        timeline, and so are copies of this step number from another one. Done once the step
        is loaded, never for a step only planned (a download or a heal takes its slot with
        ``SlotRing.acquire_for_restore``, beside newer steps): a restore that then found
        every copy bad had un-committed good copies of newer steps (a node coming back with
        the one copy missing could no longer restore them), and set-aside records with them."""
        ctx, step = self.ctx, mine.step
        if step is None:
            if mine.afresh:  # no step was ever complete: the new run saves those step numbers again
                ctx.ring.reset_to(None)
                abandon_newer(ctx.local_dir, ctx.job, -1, ctx.ring)
            return
        ctx.ring.reset_to(step)
        abandon_newer(ctx.local_dir, ctx.job, step, ctx.ring)
        if mine.lineage is not None:
            drop_other_timelines(ctx.local_dir, ctx.job, step, mine.lineage, ctx.ring)
        ctx.ring.set_global(step)

    def _transfer(self, mine: RankPlan, outgoing: list[Outgoing]) -> list[tuple[str, int, int]]:
        """Send what I must; receive my shard if the plan says so (and I lack it)."""
        ctx, step = self.ctx, mine.step
        if step is None:  # the plan always names a step here
            raise CheckpointError("restore reached a transfer without a chosen step; please report this")
        problem, received = None, None
        # Receive whenever the plan names a source, also a step already loaded: its sender
        # sends (the plan gives a source only to a rank whose node has no copy of it yet).
        wanted = mine.source is not None
        try:
            faults.check("load-transfer", ctx.rank, step)
            if _dist() is not None:
                incoming = Incoming(mine.source, self.state, ctx.allow_pickle, ctx.world_size) if wanted else None  # type: ignore[arg-type]
                problem, received = exchange(
                    ctx.rank, step, incoming, outgoing, ctx.ring, job=ctx.job, node=ctx.node, timeout_s=ctx.timeout_s
                )
        finally:
            for o in outgoing:
                o.reader.close()
        if problem is not None:
            self.dirty, self.loaded = True, None  # bytes may have landed in the live tensors
            self.report.notes.append(f"copy from rank {mine.source} rejected: {problem}")
            return [(str(mine.source_node), ctx.rank, step)]
        if received is not None:
            self._heal_now()  # an earlier round's copy, if any, is healed before a new one waits
            self.received = received
            if received.landing is None:  # set by prepare() whenever no problem was found
                raise CheckpointError("a received shard has no landing; please report this")
            if received.sidecar is not None and mesh_changed(self.state, received.sidecar.tree, ctx.allow_pickle):
                self.received = None
                received.abandon()
                if received.landing.placed:  # plain tensors may have landed in the live state
                    self.dirty, self.loaded = True, None
                return [_mesh_marker(self.report, step)]
            try:
                self._apply(step, received.sidecar, received.landing)
            except CorruptCheckpointError as exc:  # the sender's sidecar names what its shard lacks
                self.received = None
                received.abandon()
                self.dirty, self.loaded = True, None
                self.report.notes.append(f"copy from rank {mine.source} rejected: {exc}")
                return [(str(mine.source_node), ctx.rank, step)]
            except _CANNOT_LOAD as exc:  # the live state cannot take it: every rank stops
                self.received = None
                received.abandon()
                self._cannot_load(step, exc, landed=True)
        return []

    def _heal_now(self) -> None:
        """Write and commit the node's copy of what was received, here and now."""
        received, self.received = self.received, None
        if received is not None and received.can_heal:
            try:
                received.heal()
            except (OSError, CheckpointError) as exc:  # the load stands; only the node's copy is missing
                received.abandon()
                log.warning("incluster: rank %d could not write its node's copy of step %s (%s: %s); the next "
                            "save makes one", self.ctx.rank, received.step, type(exc).__name__, exc)
        elif received is not None:
            received.abandon()

    def _load_local(self, mine: RankPlan) -> list[tuple[str, int, int]]:
        """Read my node's copy straight into the live state, every chunk checked as it is
        copied; a bad copy is un-committed and reported (the caller re-plans)."""
        ctx, step = self.ctx, mine.step
        if step is None:  # the plan always names a step here
            raise CheckpointError("restore reached a transfer without a chosen step; please report this")
        folder = rank_folder(ctx.local_dir, ctx.job, ctx.rank)
        landing = None
        try:
            fd, sc, header, path = open_shard(folder, step)
            try:
                if sc.rank != ctx.rank or sc.job != ctx.job:
                    raise CorruptCheckpointError(f"{folder}: step {step} claims rank {sc.rank} of job {sc.job!r}")
                _check_world(sc, ctx, step)
                if mesh_changed(self.state, sc.tree, ctx.allow_pickle):  # before any byte lands
                    return [_mesh_marker(self.report, step)]
                if ctx.only_step is not None:
                    # load(step=N) has no older step to overwrite a bad copy's bytes with:
                    # the whole copy is checked before a byte lands (one more read of it)
                    _verify_whole(fd, sc, path)
                targets = direct_targets(
                    self.state, sc.tree, header, allow_pickle=ctx.allow_pickle, big=1, devices=("cpu", "cuda")
                )
                landing = Landing(header, segments(header, big=1), targets)
                # GPU targets: the rank's cores read and hash (training waits for the restore);
                # on the H200 host 16 threads reached 27 GB/s, 8 only 23 (bench/gpu_restore_probe.py)
                cap = 16 if landing.devices else 4
                read_verified(fd, landing, sc.checksum, path, workers=min(cap, core_share()))
            finally:
                os.close(fd)
            # A sidecar whose tree still parses but names what the shard lacks (a flipped
            # byte in a name) shows only here: it is a bad copy like any other, never an
            # error that leaves this rank out of the re-plan the others wait in.
            self._apply(step, sc, landing)
        except CorruptCheckpointError as exc:
            if landing is not None:
                self.dirty, self.loaded = True, None
            bad_copy(ctx, self.report, ctx.rank, step, exc)
            uncommit(ctx.local_dir, ctx.job, ctx.rank, step)  # the record is set aside, not lost
            ctx.ring.discard(step)  # my own slot: the ring must forget it too
            return [(ctx.node, ctx.rank, step)]
        except _CANNOT_LOAD as exc:  # not the copy: the live state cannot take it (every rank stops)
            self._cannot_load(step, exc, landed=landing is not None)
        return []

    def _download(self, mine: RankPlan) -> Problem | None:
        """The persistent copy into this node's RAM; a problem with that copy (returned) sets
        it aside on every rank. No room for it here stops every rank (``_collect``)."""
        try:
            return download(self.ctx, mine.step, mine.persistent)  # type: ignore[arg-type]
        except CheckpointError as exc:  # no slot to land the copy in (a full RAM disk), or the tier failed
            self._cannot_load(mine.step, exc, landed=False)  # type: ignore[arg-type]
            return None

    def _cannot_load(self, step: int, exc: BaseException, *, landed: bool) -> None:
        """This rank cannot load ``step`` for a reason no other copy fixes (the live state does
        not match it, no room for it): remembered, and every rank stops at the next count."""
        if landed:
            self.dirty, self.loaded = True, None
        what = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        kind = TierUnavailableError if isinstance(exc, TierUnavailableError) else CheckpointError
        self.problem = kind(f"rank {self.ctx.rank} cannot load step {step}: {what}")
        self.problem.__cause__ = exc

    def _apply(self, step: int, sc: Any, landing: Landing) -> None:
        """Every byte is verified and in place: finish the load (scratch copies, containers,
        load_state_dict where needed)."""
        _check_world(sc, self.ctx, step)
        load_into(self.state, sc.tree, landing.fetch, allow_pickle=self.ctx.allow_pickle, placed=landing.placed,
                  left_out_ok=self.ctx.left_out_ok)
        self.report.step, self.report.bytes = step, landing.nbytes
        self.loaded, self.loaded_as = step, tuple(sc.lineage)

    def _collect(self, bad: list[tuple[str, int, int]], healed: list[tuple[Any, ...]] = (), every: bool = False) -> bool:  # type: ignore[assignment]
        """True if any rank found a bad copy (every rank then re-plans). The common case,
        nobody found one, costs one all-reduce of a count; only then do the bad copies (and
        the copies healed or rebuilt this round, which the next plan may use) go to rank 0,
        O(W) bytes in all. ``every``: every rank knows a re-plan follows (no count)."""
        ctx = self.ctx
        dist = _dist()
        if dist is None:
            if self.problem is not None:
                raise self.problem
            self.exclude.update(bad)
            for h in healed:
                self.extra.append((h[0], [tuple(h[1:6])]))
            return bool(bad) or every
        if not every:
            count = torch.tensor([len(bad), int(self.problem is not None)], dtype=torch.int64,
                                 device=device_for_collectives())
            dist.all_reduce(count)
            n_bad, n_problems = (int(x) for x in count.cpu())
            if self.problem is not None:
                raise self.problem
            if n_problems:
                raise CheckpointError(
                    f"{n_problems} other rank(s) cannot load the step chosen (see their errors: a live state "
                    f"unlike the saved one, or no room in the RAM disk); no rank resumes. This rank's live state "
                    f"may already hold that step's values")
            if n_bad == 0:
                return False
        got = gather_to_zero((bad, list(healed)), ctx.rank, ctx.world_size)
        for _, hs in got or ():
            for h in hs:
                if len(h) > 6:  # rebuilt by forwarding: remember whose sidecar it carries
                    self.origin[(h[0], h[1], h[2])] = h[6]
                self.extra.append((h[0], [tuple(h[1:6])]))
        for b, _ in got or ():
            for x in b:
                self.exclude.add(tuple(x))  # type: ignore[arg-type]
                if (src := self.origin.get(tuple(x))) is not None:  # type: ignore[arg-type]
                    # a rebuilt copy failed: its sidecar is not tried again (one attempt each)
                    self.exclude.add((SIDECAR_BAD + src, x[1], x[2]))
        return True




def _mesh_marker(report: RestoreReport, step: int) -> tuple[str, int, int]:
    report.notes.append("the live DTensors are cut unlike the saved shards (another mesh or placements): resharded")
    return (MESH, -2, step)


def _check_world(sc: Any, ctx: Context, step: int) -> None:
    if sc.world_size != ctx.world_size:
        raise CheckpointError(
            f"step {step} was saved by {sc.world_size} ranks but this job has {ctx.world_size} and the plan "
            f"did not reshard it; please report this"
        )


def _reports_for_node(ctx: Context) -> bool:
    """One inventory per node is enough: torchrun's LOCAL_RANK 0 lists its host. A node
    named apart from its host (node= or INCLUSTER_NODE: several simulated nodes on one
    host, each rank with its own RAM folder) has no such rank to rely on: every rank
    lists, and rank 0 keeps one listing per node."""
    return os.environ.get("LOCAL_RANK", "0") == "0" or ctx.node != socket.gethostname()
