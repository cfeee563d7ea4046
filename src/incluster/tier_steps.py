"""Rank 0's side of the persistent tier's steps: opening a step before any rank writes
it (refusing to fork another run's timeline, clearing another timeline's manifest of
the same step), the job's owner record (one run uploads at a time) and retention (the
newest ``keep`` manifested steps stay)."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from typing import Any

from incluster.errors import CheckpointError
from incluster.tier_layout import (MANIFEST, OWNER, ROLLED_BACK, SET_ASIDE, STEP_FOLDER, manifested_steps,
                                   set_aside_reason, step_dir)

log = logging.getLogger("incluster")


class TierSteps:
    def __init__(self, tier: Any, job: str, run: str, owned: bool = False, pid: int = 0) -> None:
        self.tier = tier
        self.pid = pid or os.getpid()  # the training process, which the owner record names
        self.job = job
        self.run = run  # this Checkpointer's run id: the manifests it wrote carry it
        self._newer_told = False  # the steps of a timeline not continued were named
        self._older_checked = False  # the older steps in the tier were found this run's own
        # this run wrote the job's owner record (before a writer restart too): another run's there now took over
        self._owned = owned
        self.began = 0  # rank 0's clock (ns) when this run's Checkpointer started (the sidecars' lineage)
        self._recorded = False  # the owner record read last named this run

    def open(self, step: int, *, loaded: bool, again: bool, began: int = 0) -> None:
        """Rank 0, before any rank writes ``step``: steps only increase within a run, so a
        manifest of ``step`` or a newer step already in the tier is from another timeline.
        A run that never called load() would fork that timeline (and a restore would prefer
        the newer steps to its own): refused. After a load(), a manifest of ``step`` itself
        goes, so it never vouches for the new shards. Newer steps are kept: the restore may
        have gone back past them for a passing reason (a read that failed, a tier it could
        not list); retention never counts them, and deletes them once they are older than
        the steps it keeps. ``began``: rank 0's clock (ns) when the run started, which orders
        runs that claim the job (:meth:`_fence`)."""
        self.began = max(self.began, began)
        self._fence(f"step {step} is not uploaded")
        names = self.tier.list(self.job)
        steps = {int(m.group(1)) for m in map(STEP_FOLDER.match, names) if m}
        newer = sorted(s for s in steps if s > step)
        listing = self.tier.list(step_dir(self.job, step)) if step in steps else []
        here = MANIFEST in listing
        if again:  # close() uploading a step this run committed (catch_up.py): its own step
            return  # a manifest of it is this run's (never removed: the upload may be cut short by close())
        if not loaded and (newer or here):
            raise CheckpointError(
                f"the persistent tier already holds step(s) {newer or [step]} of job {self.job!r}, as new as this "
                f"run's step {step} or newer, and this run did not call load(): it would overwrite or fork that "
                f"job's timeline. Call load() first to go on from them, or name a new job")
        if not loaded and not self._older_checked:
            others = self._others(sorted(s for s in steps if s < step))
            if others:
                raise CheckpointError(
                    f"the persistent tier holds step(s) {others} of job {self.job!r} from another run, and this run "
                    f"did not call load(): its uploads would fork that job's timeline, and retention would delete "
                    f"them. Call load() first to go on from them, or name a new job")
            self._older_checked = True
        if not self._recorded:  # a first upload, or the record is gone
            self._claim(sorted(steps, reverse=True)[:3])
        if newer and not self._newer_told:
            # a rollback set them aside on purpose (load(step=N)): nothing to tell
            newer = [s for s in newer if not (set_aside_reason(self.tier, self.job, s) or "").startswith(ROLLED_BACK)]
        if newer and not self._newer_told:
            self._newer_told = True
            log.warning("incluster: the persistent tier holds step(s) %s of job %r, newer than this run's step %d: "
                        "from a timeline the run did not continue (its restore went back past them, or could not "
                        "read them). They are kept until retention reaches them; a restore passes over them once "
                        "this run's steps are there (each records its timeline)", newer, self.job, step)
        if here:
            log.info("incluster: the persistent tier's manifest of step %d (another timeline's) is removed before "
                     "this run's shards of it are written", step)
            self.tier.delete(f"{step_dir(self.job, step)}/{MANIFEST}")
        if SET_ASIDE in listing:  # another timeline's copy was bad: not a verdict on this run's
            self.tier.delete(f"{step_dir(self.job, step)}/{SET_ASIDE}")

    def _fence(self, what: str) -> None:
        """Refuse (``what`` it costs) once another run took the job's tier over: one that
        owns it after this one did, or that started later (a writer started again before
        its run's first upload has not claimed yet). This run is then a leftover of an
        earlier launch (a node thought dead, an allocation not ended) still training beside
        the run that replaced it, and its uploads and retention would overwrite or delete
        that run's steps."""
        owner = owner_record(self.tier, self.job)
        self._recorded = owner is not None and owner.get("run") == self.run
        if owner is None or self._recorded:
            return
        if not self._owned and _int(owner.get("began")) <= self.began:
            return  # an earlier run's record: this run takes the job over (:meth:`_claim`)
        raise CheckpointError(taken_over(self.tier, self.job, owner, what))

    def _claim(self, newest: list[int]) -> None:
        """Record this run as the job's owner: a run it replaced stops uploading at its next
        step. Warns when that run manifested one of the ``newest`` steps after this one
        started: it still trains."""
        before = owner_record(self.tier, self.job)
        body = {"run": self.run, "began": self.began, "time": time.time(), "host": socket.gethostname(),
                "pid": self.pid}
        self.tier.write(f"{self.job}/{OWNER}", memoryview(json.dumps(body).encode()))
        self._owned = self._recorded = True
        if before is None or before.get("run") == self.run:
            return
        late = next((s for s in newest if self._manifested_after(s, before.get("run"))), None)
        if late is not None:
            log.warning("incluster: run %s of job %r (host %s, pid %s) uploaded step %d after this run started: it "
                        "still trains. This run now owns the job's persistent tier, so that run uploads no more; "
                        "stop it if it is a leftover", before.get("run"), self.job, before.get("host", "?"),
                        before.get("pid", "?"), late)
        else:
            log.info("incluster: this run now owns job %r's persistent tier, after run %s (host %s)", self.job,
                     before.get("run"), before.get("host", "?"))

    def _manifested_after(self, step: int, run: Any) -> bool:
        """Whether ``run`` manifested ``step`` after this run started."""
        try:
            manifest = self._manifest(step)
        except OSError:  # no manifest (yet)
            return False
        return manifest.get("run") == run and _num(manifest.get("created")) * 1e9 > self.began > 0

    def _manifest(self, step: int) -> dict[str, Any]:
        """``step``'s manifest; empty when it cannot be parsed (or is not a file: refused as
        damaged). Raises OSError when it cannot be read."""
        try:
            raw = self.tier.read(f"{step_dir(self.job, step)}/{MANIFEST}")
            manifest = json.loads(bytes(raw))  # type: ignore[arg-type]
        except (ValueError, CheckpointError):
            return {}
        return manifest if isinstance(manifest, dict) else {}

    def _others(self, steps: list[int]) -> list[int]:
        """Which of ``steps`` (older than the one opened) another run manifested: not this
        Checkpointer's (its id is in the manifest), also when its writer was started again."""
        out = []
        for s in steps:
            if MANIFEST not in self.tier.list(step_dir(self.job, s)):
                continue  # an upload never finished: no step of any run (retention clears it)
            if self._manifest(s).get("run") != self.run:  # unreadable: not this run's (it wrote its own whole)
                out.append(s)
        return out

    def retention(self, newest: int, keep: int) -> None:
        """Keep the newest ``keep`` manifested steps up to ``newest``; delete everything older.
        Nothing, once another run took the job over (:meth:`_fence`)."""
        self._fence(f"retention after step {newest} deletes nothing")
        kept = [s for s in manifested_steps(self.tier, self.job) if s <= newest][: keep]
        for name in self.tier.list(self.job) if kept else ():
            m = STEP_FOLDER.match(name)
            if m and int(m.group(1)) < min(kept):
                self.tier.delete(f"{self.job}/{name}")
        sweep = getattr(self.tier, "sweep_partial", None)
        if sweep is not None:  # RUN.json's (its step folders' go with them), older than this run's claim
            try:
                sweep(self.job, f"{self.job}/{OWNER}")
            except Exception as exc:  # noqa: BLE001 - tidying only: never retention's failure
                log.info("incluster: could not sweep half-written files in %s: %s", self.job, exc)


def owner_record(tier: Any, job: str) -> dict[str, Any] | None:
    """The job's owner record (``<job>/RUN.json``: the run that uploads its steps), or None
    when there is none or it cannot be read (a run that wrote one reads it whole)."""
    try:
        owner = json.loads(bytes(tier.read(f"{job}/{OWNER}")))  # type: ignore[arg-type]
    except FileNotFoundError:
        return None
    except (ValueError, CheckpointError):  # unreadable, or not a file: taken as no record
        return None
    return owner if isinstance(owner, dict) else None


def replaced_by(tier: Any, job: str, run: str, began: int) -> dict[str, Any] | None:
    """The record of a run that started after this one (``began``: rank 0's clock, ns) and
    owns the job's tier: this run must not touch the job's steps there. None otherwise."""
    owner = owner_record(tier, job)
    if owner is None or owner.get("run") == run or _int(owner.get("began")) <= began:
        return None
    return owner


def taken_over(tier: Any, job: str, owner: dict[str, Any], what: str) -> str:
    """The refusal of a run another run took the job over from (``owner``: its record)."""
    when = _num(owner.get("time"))
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when)) if when else "an unknown time"
    run = str(owner.get("run", "?"))[:12]
    return (f"another run of job {job!r} took over its persistent tier (host {owner.get('host', '?')}, pid "
            f"{owner.get('pid', '?')}, run {run}, since {since}): {what}. Stop this run if that one is meant to "
            f"train; if that run has ended, delete {getattr(tier, 'url', tier)}/{job}/{OWNER}")


def _int(value: Any) -> int:
    """A whole number from a record (exact: clocks in ns), 0 when it is missing or not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else int(_num(value))


def _num(value: Any) -> float:
    """A number from a record, 0 when it is missing or not a finite one."""
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return out if math.isfinite(out) else 0.0


def began_of(sidecar: dict[str, Any]) -> int:
    """When the run that saved a step started (rank 0's clock, ns: its lineage's first
    field), from the step's parsed sidecar; 0 when it does not say."""
    lineage = sidecar.get("lineage")
    return _int(lineage[0]) if isinstance(lineage, list) and lineage else 0
