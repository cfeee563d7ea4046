"""What the operator tools know about stored checkpoints: copies, leftovers, steps.

Plain records built by :mod:`incluster.tools.scan` (RAM folders) and
:mod:`incluster.tools.remote` (the persistent tier); no I/O here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from incluster.format.sidecar import Sidecar
from incluster.tiers.persistent import FsspecTier

TIER_ORDER = {"ram": 0, "replica": 1, "persistent": 2}


@dataclass
class Copy:
    """One stored copy of one rank's shard of one step."""

    job: str
    step: int
    rank: int
    tier: str  # "ram" (the rank's own copy), "replica" (a peer's copy), "persistent"
    where: str  # the sidecar's path or URL, as shown to the user
    folder: str = ""  # local copies: the rank folder
    sidecar: Sidecar | None = None
    error: str | None = None  # why the sidecar is unusable (a fault)
    damage: str | None = None  # the shard file is missing or not the size its sidecar says (seen by ls)
    remote: tuple[FsspecTier, str] | None = None  # persistent copies: tier and shard key
    manifest_checksum: Any = None  # persistent copies: what COMMITTED.json records
    node: str | None = None  # local copies without a usable sidecar: the node its folder's other records name

    @property
    def holder(self) -> str:
        """The node (or tier) keeping this copy."""
        if self.tier == "persistent":
            return "persistent"
        if self.sidecar is None:
            if self.node:
                return self.node
            return os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(self.where)))) or "?"
        return str(self.sidecar.extra.get("replica_on") or self.sidecar.node)

    @property
    def nbytes(self) -> int:
        return self.sidecar.checksum.size if self.sidecar is not None else 0

    @property
    def shared(self) -> bool:
        """A replica whose bytes are a data-parallel peer's own shard on the same node."""
        return self.sidecar is not None and self.sidecar.extra.get("shared_with") is not None

    @property
    def stored(self) -> int:
        """Bytes this copy takes of its own (none for a shared replica)."""
        return 0 if self.shared else self.nbytes


@dataclass(frozen=True)
class Note:
    """Harmless leftovers: reported, never a fault."""

    path: str
    what: str


@dataclass
class Inventory:
    copies: list[Copy] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    problems: list[tuple[str, int, str]] = field(default_factory=list)  # (job, step, fault) outside any one copy
    folders: set[tuple[str, int]] = field(default_factory=set)  # (job, rank) with a folder (or tier entry) scanned
    jobs: set[str] = field(default_factory=set)  # every job found, before --job filtered them

    @staticmethod
    def rank_folders(dirs: list[str]) -> str:
        """For the message when nothing was found: a DIR that is one rank's folder of a job
        (``<job>/rank-RRRRR``) is not where copies are looked for; name its job folder."""
        hits = [d for d in dirs if re.fullmatch(r"rank-\d{5,}", os.path.basename(os.path.normpath(d)))]
        steps = [d for d in dirs if re.fullmatch(r"step-\d{12,}", os.path.basename(os.path.normpath(d)))]
        return "".join(f"; {d} is one rank's folder: name its job folder "
                       f"({os.path.dirname(os.path.normpath(d))}) or the node's RAM folder" for d in hits) + "".join(
            f"; {d} is one step's folder of a persistent tier: name the tier "
            f"(--persistent {os.path.dirname(os.path.dirname(os.path.normpath(d)))})" for d in steps)

    def elsewhere(self, job: str | None) -> str:
        """Where --job left everything out: the jobs that are there, for the message."""
        others = sorted(self.jobs - {job}) if job is not None and job not in self.jobs else []
        return f"; job {job!r} is not there, these are: {', '.join(others)}" if others else ""

    def set_aside_other_timelines(self) -> None:
        """Copies a restore would not use (:mod:`incluster.recovery.lineage`): of a timeline
        a later restore went back from, or an older timeline's at a step a later one saved
        again. They move to the notes, so no step counts them."""
        from incluster.recovery.lineage import latest_of

        unused: set[int] = set()
        for job in {c.job for c in self.copies}:
            mine = [c for c in self.copies if c.job == job and c.sidecar is not None]
            latest = latest_of((c.step, c.sidecar.lineage) for c in mine)  # type: ignore[union-attr]
            for c in mine:
                if c.sidecar.lineage != latest.get(c.step):  # type: ignore[union-attr]
                    unused.add(id(c))
                    self.notes.append(Note(c.where, f"a copy of step {c.step} from a timeline a later restore went "
                                                    f"back from: a restore does not use it"))
        self.copies = [c for c in self.copies if id(c) not in unused]

    def partial_views(self, steps: dict[tuple[str, int], dict[int, list[Copy]]] | None = None) -> dict[str, list[int]]:
        """Jobs whose newest step's ranks (of ``steps``, default all) are not all in the
        folders scanned (one node's RAM folder of a multi-node job): which ranks no folder
        holds at all. Such a listing cannot tell whether a step is complete."""
        out: dict[str, list[int]] = {}
        # newest first: the first seen per job decides
        for (job, _), ranks in (self.steps() if steps is None else steps).items():
            if job in out:
                continue
            w, _ = world_size(ranks)
            if w is not None:
                out[job] = [r for r in range(w) if (job, r) not in self.folders]
        return {job: m for job, m in out.items() if m}

    def steps(self) -> dict[tuple[str, int], dict[int, list[Copy]]]:
        """``(job, step) -> rank -> copies``, each rank's copies in tier order."""
        out: dict[tuple[str, int], dict[int, list[Copy]]] = {}
        for c in self.copies:
            out.setdefault((c.job, c.step), {}).setdefault(c.rank, []).append(c)
        for ranks in out.values():
            for copies in ranks.values():
                copies.sort(key=lambda c: (TIER_ORDER[c.tier], c.where))
        return dict(sorted(out.items(), key=lambda kv: (kv[0][0], -kv[0][1])))


def size_damage(where: str, size: int | None, sidecar: Sidecar) -> str | None:
    """Why a shard file of ``size`` bytes (None: missing) cannot be the copy ``sidecar`` describes."""
    if size is None:
        return f"{where}: the shard file is missing"
    if size != sidecar.checksum.size:
        return f"{where}: {size} bytes on disk but the commit record says {sidecar.checksum.size} (truncated or padded)"
    return None


def world_size(ranks: dict[int, list[Copy]]) -> tuple[int | None, str | None]:
    """The step's world size from its readable sidecars, or a reason it is unknown."""
    sizes = {c.sidecar.world_size for cs in ranks.values() for c in cs if c.sidecar is not None}
    if len(sizes) == 1:
        return sizes.pop(), None
    if not sizes:
        return None, "no readable sidecar"
    return None, f"sidecars disagree on the world size ({', '.join(map(str, sorted(sizes)))})"


def missing_ranks(ranks: dict[int, list[Copy]], ok: Callable[[Copy], bool] = lambda c: c.sidecar is not None) -> list[int] | None:
    """Ranks 0..W-1 with no copy satisfying ``ok``; None if W is unknown."""
    w, _ = world_size(ranks)
    if w is None:
        return None
    return [r for r in range(w) if not any(ok(c) for c in ranks.get(r, []))]
