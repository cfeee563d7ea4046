"""Restoring from the persistent tier (tier 2) when it holds a newer step than the cluster.

Rank 0 compares the newest manifested persistent step with the newest complete
in-cluster step; if the persistent one is newer, every rank whose node lacks its shard
of that step downloads it (verified against its sidecar and the manifest) into one of its
slots, which heals its node's RAM tier on the way; the others read their node's copy.

A persistent step saved by another world size is resharded: each old shard is
downloaded once, by the rank rank 0 assigns it to, into that old rank's folder on its
node (verified, then committed like a replica), and the resharding restore proceeds from
the cluster's RAM (:mod:`incluster.recovery.reshard`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from incluster.errors import CheckpointError, CorruptCheckpointError, TierUnavailableError
from incluster.recovery import lineage
from incluster.recovery.plan import RankPlan

log = logging.getLogger("incluster")
LIST_TIMEOUT_S = 15.0  # how long a restore with a complete step in RAM waits for tier 2's listing
UNREADABLE = "<manifest>"  # an exclusion: the step's manifest cannot be read (no evidence, nor a step)


Manifests = dict[int, tuple[dict[int, Any], int, lineage.Lineage]]  # step -> (records by rank, world, lineage)


def tier_manifests(ctx: Any, in_cluster: int | None, exclude: set[tuple[str, int, int]]) -> Manifests:
    """Rank 0: every manifested step of tier 2, with its records, world size and lineage
    (the restore's evidence of the timelines, newer steps or not; a step an earlier
    restore set aside is evidence too, and goes into ``exclude``, never tried again). A
    tier that cannot be listed is passed over while the cluster's RAM has a complete step
    (``in_cluster``), and is a TierUnavailableError otherwise."""
    if ctx.persistent is None:
        return {}
    from incluster.tier_layout import MANIFEST, list_steps, step_dir

    try:
        # With a complete step in RAM a hung object store is not waited for long.
        steps = list_steps(ctx.persistent, ctx.job, None if in_cluster is None else LIST_TIMEOUT_S)
    except TierUnavailableError as exc:
        if in_cluster is None:
            raise TierUnavailableError(
                f"{str(exc).rstrip('.')}. No complete step is in the cluster's RAM either: nothing is loaded, "
                f"rather than starting afresh while the tier may hold this job's checkpoints. Fix the tier (its "
                f"URL, endpoint or credentials: persistent_options), or leave persistent= out to start without it"
            ) from None
        log.warning("incluster: %s; step %d is restored from the cluster's RAM without knowing whether the "
                    "persistent tier holds a newer one", exc, in_cluster)
        return {}
    out: Manifests = {}
    for step, usable in steps.items():
        # A step passed over (set aside by an earlier restore, or in an earlier round of this
        # one) is never tried again, but its manifest still tells which timeline it is of:
        # without it, a timeline it alone shows went back past a step would be forgotten,
        # and that abandoned step loaded.
        if not usable and ("<persistent>", -1, step) not in exclude:
            log.info("incluster: persistent step %d was set aside by an earlier restore (a bad copy); passed over",
                     step)
            exclude.add(("<persistent>", -1, step))
        if (UNREADABLE, -1, step) in exclude:
            continue
        try:
            manifest = json.loads(ctx.persistent.read(f"{step_dir(ctx.job, step)}/{MANIFEST}"))
            records = {int(r["rank"]): r for r in manifest["ranks"]}
            world = int(manifest["world_size"])
            # the count first: range() of an absurd world size (a damaged record) is not built
            if world < 1 or len(records) != world or sorted(records) != list(range(world)):
                raise ValueError("it lacks some rank's record")
        except (OSError, ValueError, KeyError, TypeError, RecursionError, CorruptCheckpointError) as exc:
            log.warning("incluster: persistent step %d has an unreadable manifest (%s); skipped", step, exc)
            exclude.update({("<persistent>", -1, step), (UNREADABLE, -1, step)})
            continue
        out[step] = (records, world, lineage.parse(manifest.get("lineage")))
    return out


def persistent_plan(
    ctx: Any, in_cluster: int | None, manifests: Manifests, exclude: set[tuple[str, int, int]],
    shared: dict[str, Any] | None = None, node_index: list[int] | None = None, remesh: bool = False,
    latest: dict[int, lineage.Lineage] | None = None, own: Callable[[int], set[int]] | None = None,
) -> list[RankPlan] | None:
    """Rank 0: plans to restore from tier 2 when its newest usable manifested step is newer
    than the newest complete in-cluster step (a tie prefers the cluster's RAM). Usable: of
    the lineage the restore takes for that step (``latest``, from every copy in RAM and
    the tier: :func:`incluster.recovery.lineage.current`), so a step of a timeline a later
    one went back from, or saved again by a later timeline, is passed over. A step of
    another world size is resharded: old shard o is fetched by rank o mod W, and the
    resharding plan's shared part goes into ``shared``. Of the same world size, a rank
    whose own node holds its shard of the step (``own(step)``: copies of the same
    timeline, so the same bytes) reads that copy; only the others download."""
    for step in sorted(manifests, reverse=True):
        if in_cluster is not None and step <= in_cluster:
            return None
        if ("<persistent>", -1, step) in exclude:
            continue
        records, world, lin = manifests[step]
        if latest is not None and latest.get(step) != lin:
            log.warning("incluster: persistent step %d belongs to a timeline a later restore went back from, or "
                        "one that saved step %d again; skipped (delete its folder in the tier if it is not wanted)",
                        step, step)
            exclude.add(("<persistent>", -1, step))
            continue
        if world != ctx.world_size or remesh:
            if shared is None or node_index is None:  # "refuse" is said by the restore, as from RAM
                log.warning("incluster: persistent step %d was saved by %d ranks; this job has %d", step, world,
                            ctx.world_size)
                exclude.add(("<persistent>", -1, step))
                continue
            server_of = [o % ctx.world_size for o in range(world)]
            shared["maps"] = server_of + list(node_index)
            mine: dict[int, list[Any]] = {r: [] for r in range(ctx.world_size)}
            for o in range(world):
                mine[server_of[o]].append(records[o])
            return [RankPlan(step, None, (), "persistent", {"reshard": mine[r]}, world=world, reshard=True,
                             lineage=lin) for r in range(ctx.world_size)]
        local = own(step) if own is not None else set()
        return [RankPlan(step, None, (), None, None, transfers=False, lineage=lin) if r in local else
                RankPlan(step, None, (), "persistent", records[r], lineage=lin) for r in range(ctx.world_size)]
    return None


@dataclass(frozen=True)
class Problem:
    """What went wrong fetching a persistent copy; ``bad``: the tier's copy itself failed
    (a checksum, a size, a record that does not parse, a file missing), so later restores
    pass over the step (:func:`set_aside`), unlike a full RAM disk or a tier not answering."""

    text: str
    bad: bool

    def __str__(self) -> str:
        return self.text


def fetch_old_shards(ctx: Any, step: int, records: list[dict[str, Any]], world: int) -> Problem | None:
    """Download the old shards this rank serves in a resharding restore from tier 2 into
    their old ranks' folders on this node, each verified against its sidecar and the
    manifest before it is committed. None, or what went wrong."""
    import mmap
    import os

    from incluster.format.checksum import Checksum, verify
    from incluster.format.sidecar import write_sidecar
    from incluster.tier_layout import step_dir
    from incluster.staging.slots import sidecar_file, step_file
    from incluster.tiers.local import rank_folder
    from incluster.writer.local_commit import parse_received_sidecar

    for record in records:
        try:
            owner = int(record["rank"])
            base = f"{step_dir(ctx.job, step)}/rank-{owner:05d}"
            where = f"old rank {owner}'s shard of persistent step {step}"
            expect = Checksum.from_json(record["checksum"], where)
            sc = parse_received_sidecar(
                ctx.persistent.read(base + ".json"), where, rank=owner, step=step, job=ctx.job, size=expect.size
            )
            if sc.checksum != expect or sc.world_size != world:
                return Problem(f"{where}: sidecar and manifest disagree", True)
            folder = rank_folder(ctx.local_dir, ctx.job, owner)
            final = os.path.join(folder, step_file(step))
            tmp = f"{final}.fetch-{os.getpid()}"
            with _local():
                os.makedirs(folder, mode=0o700, exist_ok=True)
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with _local():
                    os.ftruncate(fd, expect.size)
                    mm = mmap.mmap(fd, expect.size) if expect.size else None
                try:
                    got = ctx.persistent.read(base + ".safetensors", into=memoryview(mm) if mm is not None else memoryview(bytearray()))
                    if got != expect.size:
                        raise CorruptCheckpointError(f"{where}: {got} bytes downloaded, the manifest says {expect.size}")
                    verify(mm if mm is not None else b"", expect, where)
                finally:
                    if mm is not None:
                        mm.close()
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
            with _local():
                os.replace(tmp, final)
                # held on this node now, as a download of a rank's own shard records it (ls shows where)
                own = {k: v for k, v in sc.extra.items() if k not in ("shared_with", "replica_on")}
                write_sidecar(os.path.join(folder, sidecar_file(step)),
                              dataclasses.replace(sc, node=ctx.node, extra={**own, "restored_from": "persistent"}))
        except (_LocalError, OSError, ValueError, KeyError, TypeError, CorruptCheckpointError) as exc:
            return _problem(where if 'where' in locals() else 'a persistent shard', exc)
    return None


def _tier_read(ctx: Any, path: str, where: str, **kw: Any) -> Any:
    """A read from tier 2. A file not there is the copy's problem (returned as such); any
    other failure, after the tier's own retries, is the tier's: ``TierUnavailableError``,
    never a copy set aside as bad (which could end in "delete the tier to start afresh")."""
    try:
        return ctx.persistent.read(path, **kw)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise TierUnavailableError(f"{where}: reading it from the persistent tier failed ({exc})") from exc


def download(ctx: Any, step: int, record: dict) -> Problem | None:  # type: ignore[type-arg]
    """Fetch my shard of ``step`` from tier 2 into one of my slots, verify, commit (heal)."""
    from incluster.format.checksum import Checksum
    from incluster.tier_layout import step_dir
    from incluster.writer.local_commit import commit_received, parse_received_sidecar

    base = f"{step_dir(ctx.job, step)}/rank-{ctx.rank:05d}"
    where = f"rank {ctx.rank}'s shard of persistent step {step}"
    try:
        expect = Checksum.from_json(record["checksum"], where)
        sc = parse_received_sidecar(
            _tier_read(ctx, base + ".json", where), where, rank=ctx.rank, step=step, job=ctx.job, size=int(record["size"])
        )
        if sc.checksum != expect:
            return Problem(f"{where}: sidecar and manifest disagree", True)
        # A copy this node kept of a step the cluster as a whole lost (its save failed
        # elsewhere), or another timeline's: the manifested copy replaces it
        slot = ctx.ring.acquire_for_restore(step)
        try:
            with _local():
                ctx.ring.prepare(slot, expect.size)
            into = memoryview(slot.mm) if slot.mm is not None else memoryview(bytearray())
            for attempt in (1, 2):  # bytes that do not match are read again once: not set aside on one bad read
                try:
                    got = _tier_read(ctx, base + ".safetensors", where, into=into)
                    if got != expect.size:
                        raise CorruptCheckpointError(f"{where}: {got} bytes downloaded, the manifest says {expect.size}")
                    with _local():
                        commit_received(ctx.ring, slot, sc, where, node=ctx.node, restored_from="persistent")
                    break
                except CorruptCheckpointError:
                    if attempt == 2:
                        raise
                    log.warning("incluster: %s did not match its checksums as downloaded; reading it again", where)
        except BaseException:
            ctx.ring.release(slot)
            raise
    except (_LocalError, OSError, ValueError, KeyError, CorruptCheckpointError) as exc:
        return _problem(where, exc)
    return None


def set_aside(ctx: Any, step: int, problem: Problem) -> None:
    """A copy of persistent ``step`` was found bad: later restores pass over the step
    (:func:`incluster.tier_layout.set_aside`)."""
    from incluster.tier_layout import set_aside as mark

    mark(ctx.persistent, ctx.job, step, problem.text)


def abandon_in_tier(tier: Any, job: str, step: int, run: str, began: int) -> None:
    """After ``load(step=N)`` (rank 0): the tier's steps newer than N are of the timeline
    the rollback left. Set aside, so that no restore before this run's next upload takes
    one (a restart, or the cluster's RAM lost); an upload of this run's own step of that
    number clears the mark. Not when a later run owns the job's tier (``run``, ``began``:
    this run's): they are its steps. Best effort: a tier that cannot be listed is said once."""
    if tier is None:
        return
    from incluster.tier_layout import ROLLED_BACK, list_steps, set_aside as mark
    from incluster.tier_steps import replaced_by, taken_over

    try:
        owner = replaced_by(tier, job, run, began)
    except OSError as exc:
        owner = None
        log.info("incluster: the persistent tier's owner record could not be read (%s)", exc)
    if owner is not None:
        log.warning("incluster: %s", taken_over(tier, job, owner, f"its steps newer than step {step} are kept"))
        return

    try:
        steps = list_steps(tier, job, LIST_TIMEOUT_S)
    except CheckpointError as exc:
        log.warning("incluster: the persistent tier's steps newer than step %d could not be listed (%s): until this "
                    "run's next upload there, a restore with the cluster's RAM lost may take one of them", step, exc)
        return
    left = sorted(newer for newer, usable in steps.items() if newer > step and usable)
    for newer in left:
        mark(tier, job, newer, f"{ROLLED_BACK}{step}), which rolled the run back past it")
    if left:
        log.warning("incluster: load(step=%d) rolled the run back: the persistent tier's step(s) %s are set aside "
                    "(SET_ASIDE.json in each; no restore takes them; retention deletes them in time)", step, left)


class _LocalError(Exception):
    """This node failed to hold the copy (its RAM disk), not the tier's copy."""


@contextlib.contextmanager
def _local() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise _LocalError(f"this node could not write it ({exc})") from exc


def _problem(where: str, exc: BaseException) -> Problem:
    """``where: exc``, without naming the copy twice (verification names it already); bad
    where the tier's copy failed (its checksums, its records, a file of it missing), not
    this node (``_LocalError``: a full or failing RAM disk) nor the tier's answer (OSError)."""
    text = str(exc)
    bad = isinstance(exc, (CorruptCheckpointError, FileNotFoundError, ValueError, KeyError, TypeError))
    return Problem(text if text.startswith(where) else f"{where}: {text}", bad)
