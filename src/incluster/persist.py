"""Uploads to the persistent tier, in the writer, never in the trainer's way.

Layout (:mod:`incluster.tier_layout`): ``<persistent>/<job>/step-SSSSSSSSSSSS/rank-RRRRR.
{safetensors,json}`` and ``COMMITTED.json``, the manifest. Each rank
uploads its shard straight from the mapped slot (streamed in chunks), then records it in
the job store (``pr/N/<rank>`` and a count ``p/N``); the rank completing the count
writes the manifest, sets the outcome ``po/N`` and applies retention (newest K manifested
steps kept, anything older deleted). Readers trust a step only if its manifest exists.

One upload at a time per rank: a persistent save that is due while the previous upload
still runs is skipped and counted (and published, so no rank waits for it); uploads are
never queued without bound. A ``save(persist=True)`` is the exception the caller asked
for: it waits for the upload that runs (scheduled ones are skipped meanwhile). Transient errors are retried with backoff; a permanent one
fails that step's upload and is reported, while training and in-cluster saves go on.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from incluster.commit import Coordinator, Outcome
from incluster.errors import CheckpointError
from incluster.testing import faults
from incluster.tier_layout import MANIFEST, step_dir
from incluster.tier_steps import TierSteps, began_of
from incluster.tiers.persistent import open_tier

log = logging.getLogger("incluster")
NOT_DUE = "skipped: not due (persistent_interval_s)"
AGAIN = 1 << 20  # the timeline of a committed step's upload made again (catch_up.py): its job-store keys apart
CANCELLED = "cancelled: close() ended the upload"


@dataclass(frozen=True, kw_only=True)
class PersistParams:
    """Picklable: crosses into the writer process."""

    url: Any  # a path or URL, or a picklable Tier object
    options: dict[str, Any] = field(default_factory=dict)
    job: str
    rank: int
    world_size: int
    every: int = 1
    interval_s: float | None = None
    keep: int = 2
    retries: int = 3
    timeout_s: float = 600.0
    run: str = ""  # rank 0's process's run id (commit.process_run), in the manifests: this run's own steps
    owned: bool = False  # a step of this run reached the tier before this writer started: it owns the job's record
    trainer_pid: int = 0  # the training process (RUN.json names it: the writer's own pid is no process to stop)


def fix_for(error: str, folder: str | None = None) -> str:
    """What to check, for an upload error's text ("" when there is nothing to add);
    ``folder``: the tier's local folder, if it is one (no credentials to check there)."""
    if folder is not None and "PermissionError" in error:
        return f" - check that this process may write to the persistent folder {folder} (its owner and mode)"
    if any(k in error for k in ("PermissionError", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                "Forbidden")):
        return (" - the tier refused these credentials or this path: check the key and secret "
                "(persistent_options, or the AWS settings) and the bucket's policy")
    if any(k in error for k in ("EndpointConnectionError", "ConnectionRefused", "Connection refused", "ConnectTimeout",
                                "ReadTimeout", "TimeoutError", "ConnectionError")):
        return (" - the tier did not answer: check that it is up, and its endpoint (persistent_options "
                "client_kwargs endpoint_url, or AWS_ENDPOINT_URL)")
    return ""


def _verdict(value: str | None) -> tuple[str, str] | None:
    """(rank, why) of a store verdict ``fail:<rank>:<why>``; None for anything else."""
    parts = (value or "").split(":", 2)
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "fail" else None


def _skipped_elsewhere(value: str | None) -> str | None:
    """A store verdict saying another rank skipped the upload, as a skip ("skipped: ...")."""
    v = _verdict(value)
    return f"skipped: rank {v[0]} {v[1]}" if v is not None and v[1].startswith("skipped") else None


def _words(value: str) -> str:
    """A store verdict ``fail:<rank>:<why>`` as the reader should see it."""
    v = _verdict(value)
    if v is None:
        return value
    return v[1] if v[0] == "?" else f"rank {v[0]}: {v[1]}"


class _Cancelled(Exception):
    """close() gave up on the upload: it stops before its next operation on the tier."""


class Uploader:
    def __init__(self, params: PersistParams, coord: Coordinator, decisions: Coordinator | None = None,
                 spare: Callable[[], Coordinator] | None = None) -> None:
        self.p = params
        self.coord = coord
        self._spare = spare  # makes a client of its own for a blocking wait, when first needed
        self._waits: Coordinator | None = None
        self._upload_waits: Coordinator | None = None
        # Time-based decisions block on their own store client: a store client serves one
        # blocking wait at a time, and an upload's count must never queue behind one.
        self.decisions = decisions or coord
        self._last_failure = ""  # the last upload failure warned of (steps as N): repeats go to INFO
        self.tier = open_tier(params.url, params.options)
        self.steps = TierSteps(self.tier, params.job, params.run, params.owned, params.trainer_pid)  # rank 0 opens steps, applies retention
        self._folder = str(getattr(self.tier, "url", "")) if getattr(self.tier, "posix", False) else None
        # An object store's client retries on its own (botocore and s3fs: about 18 s for a
        # refused endpoint); retrying around it again multiplied that, so a store that was
        # down held close() for minutes. Its own policy rules (persistent_options).
        self.retries = 1 if getattr(self.tier, "posix", True) is False else params.retries
        self._busy = threading.Lock()
        self._last_t: float | None = None  # rank 0: when the last time-based persistent save was due
        self._decide_lock = threading.Lock()
        self.skipped = 0
        self.failed = 0
        self.uploading: int | None = None  # the step whose upload runs
        self.trouble: str | None = None  # the error the running upload is retrying after
        self._trouble_told: int | None = None  # the upload whose trouble a skip warning named
        self._began = 0.0  # when the running upload started
        self._last_took: float | None = None  # how long the last upload that got through took
        # close() may give up on an upload that still runs (a hung store); with the writer
        # on the trainer's threads that upload goes on, and must then write no manifest.
        self._fate = threading.Lock()
        self._cancelled = False
        self._counted = False  # this rank's shard of the upload in flight was counted
        self._timeline = 0  # the load() count of the upload in flight (its keys: Coordinator.at)
        self._done: Callable[[str | None], None] | None = None
        self._completing = False  # this rank's count completed the upload in flight: it writes the manifest
        self.loaded = False  # the save being uploaded came after a load() (CommitRequest.loaded)
        # With interval_s, steps whose due-or-not decision is awaited: each is reported
        # exactly once, by its decision or by cancel(); after cancel() nothing starts.
        # Keyed (timeline, step): a step number saved again after a load() is another step.
        self._deciding: dict[tuple[int, int], Callable[[str | None], None]] = {}
        self._closed = False
        # Steps being decided or uploaded whose report has not returned yet: close() waits
        # for none (a report sent after close() would be lost, an upload reads its slot).
        self._active = 0
        self._idle = threading.Condition(self._fate)
        # The save(persist=True) waiting for the upload that runs, if any: (timeline, step).
        # While it waits a scheduled upload is skipped as if one ran (uploads stay in step order).
        self._forced: tuple[int, int] | None = None

    def due(self, step: int, ordinal: int) -> bool:
        """Whether this save may go to the persistent tier: the same answer on every rank.
        ``ordinal`` is the save's place in the job's sequence of saves, not a count of this
        writer's commits: a rank whose commit failed, whose writer was started again, or
        that skipped a save the others made (writer/sequence.py) still agrees. With
        ``interval_s`` every save may (rank 0's clock decides later, off the commit path:
        :meth:`start`); its slot stays pinned until the decision."""
        if self.p.interval_s is None:
            return ordinal % self.p.every == 0
        return True

    def start(self, step: int, sidecar: bytes, buf: Any, size: int, done: Callable[[str | None], None],
              timeline: int = 0, forced: bool = False) -> bool:
        """Upload in the background; False (skipped) if the previous upload still runs.
        With ``interval_s``, first learn (in the background) whether this step is due.
        ``timeline``: load() calls before the save (its keys in the job store).
        ``forced`` (``save(persist=True)``): uploaded after the upload that still runs,
        never skipped for it, and without a time-based decision."""
        if forced:
            return self._start_forced(step, sidecar, buf, size, done, timeline)
        if self.p.interval_s is None:
            return self._start(step, sidecar, buf, size, done, timeline)

        with self._fate:
            if self._closed:
                return False
            self._deciding[(timeline, step)] = done
            self._active += 1

        def decide_then_start() -> None:
            try:
                due = self._decide(step, timeline)
            except Exception as exc:  # noqa: BLE001 - the store is gone: not due, said once
                due, why = False, f"skipped: no decision from rank 0 ({type(exc).__name__}: {exc})"
                self._undecided(step, timeline)
                self._publish_failure(step, why[:300], timeline)  # if rank 0 did decide it due, no rank waits for us
            else:
                why = NOT_DUE
            if due:
                self._start(step, sidecar, buf, size, done, timeline, deciding=True)
                return
            with self._fate:
                mine = self._deciding.pop((timeline, step), None) is not None  # else cancel() reported it
            if mine:
                self._report(done, why)

        threading.Thread(target=decide_then_start, name=f"incluster-persist-due-{step}", daemon=True).start()
        return True

    def _start_forced(self, step: int, sidecar: bytes, buf: Any, size: int, done: Callable[[str | None], None],
                      timeline: int) -> bool:
        """Wait behind the upload that runs, on a thread of its own (reported by cancel()
        if close() comes first). At most one waits, its slot pinned: a newer forced save
        replaces it (reported skipped), so a run forcing saves on a slow tier never pins
        every slot. Every rank was asked alike, so every rank uploads its shard of it."""
        key = (timeline, step)
        with self._fate:
            if self._closed:
                return False
            replaced, self._forced = self._forced, key
            old_done = self._deciding.pop(replaced, None) if replaced is not None else None
            self._deciding[key] = done
            self._active += 1
            waiting = self.uploading
        if replaced is not None and old_done is not None:
            self._publish_failure(replaced[1], "skipped, previous upload still running", replaced[0])
            self._report(old_done, f"skipped: step {step} (persist=True) came while it waited for the upload before it")
        if waiting is not None:
            log.info("incluster: rank %d: the persistent save of step %d (persist=True) waits for the upload of step "
                     "%d to end", self.p.rank, step, waiting)

        def wait_then_start() -> None:
            why = self._not_forced_alike(step, timeline)
            if why is not None:
                with self._fate:
                    if self._forced == key:
                        self._forced = None
                    mine = self._deciding.pop(key, None) is not None  # else cancel() reported it
                self._publish_failure(step, why, timeline)  # a rank that did upload it waits no longer
                if mine:
                    log.warning("incluster: rank %d: %s; step %d is not in the persistent tier", self.p.rank, why,
                                step)
                    self._report(done, why)
                return
            while not self._busy.acquire(timeout=0.5):
                with self._fate:
                    if key not in self._deciding:  # replaced, or cancel() reported it
                        return
            with self._fate:
                if self._forced == key:
                    self._forced = None
            # Not ours any more (replaced or cancelled meanwhile): _start releases the lock.
            self._start(step, sidecar, buf, size, done, timeline, deciding=True, acquired=True)

        threading.Thread(target=wait_then_start, name=f"incluster-persist-wait-{step}", daemon=True).start()
        return True

    def _not_forced_alike(self, step: int, timeline: int) -> str | None:
        """Why ``save(step, persist=True)`` cannot reach the tier: not every rank uploads it
        (another passed persist=None for a step not due, or False), and this rank's upload
        waited ``slot_timeout_s`` for their shards. Known once the step commits: each rank
        that uploads a step counts itself first (``persistent_every`` only: with
        ``persistent_interval_s`` the others' uploads are decided later, and not checked)."""
        if self.p.world_size <= 1 or timeline >= AGAIN or self.p.interval_s is not None:
            return None  # AGAIN: close()'s catch-up, decided alike from words
        coord = self._wait_client().at(timeline)
        try:
            if coord.outcome(step, self.p.timeout_s) != Outcome.COMMITTED.value:  # read only; failed: the upload says
                return None
            n = coord.forced_count(step)
        except Exception:  # noqa: BLE001 - a lost store: the upload reports that
            return None
        if n >= self.p.world_size:
            return None
        return (f"save({step}, persist=True): only {n} of {self.p.world_size} ranks upload step {step} (the "
                f"others passed persist=None for a step not due, or persist=False): pass the same persist= on "
                f"every rank")

    def _wait_client(self) -> Coordinator:
        """A store client for a blocking wait, never the one uploads count with (a client
        serves one call at a time): the decisions' own where there is one, else one made
        at the first wait (a persist=True save; most runs never make it)."""
        if self.decisions is not self.coord or self._spare is None:
            return self.decisions
        if self._waits is None:
            self._waits = self._spare()
        return self._waits

    def _waits_of_uploads(self) -> Coordinator:
        """The client an upload waits on (rank 0's gate, the step's outcome: up to
        ``timeout_s`` each), never ``coord``: a store client serves one call at a time,
        and the commit thread publishes a skipped or failed step on ``coord`` - behind a
        wait there, that commit (and, once the ring filled, save()) waited for the upload."""
        if self.p.world_size <= 1 or self._spare is None:
            return self.coord  # one rank: nothing waits
        if self._upload_waits is None:
            self._upload_waits = self._spare()
        return self._upload_waits

    def _report(self, done: Callable[[str | None], None] | None, why: str | None) -> None:
        """Tell a step's outcome (``done`` None: told already), then count it as no longer active."""
        try:
            if done is not None:
                done(why)
        finally:
            with self._fate:
                self._active -= 1
                if self._active == 0:
                    self._idle.notify_all()

    def _decide(self, step: int, timeline: int) -> bool:
        """Time-based: rank 0's clock decides, every other rank reads its decision (bounded)."""
        decisions = self.decisions.at(timeline)
        if self.p.rank != 0:
            said = decisions.persist_outcome(-step - 1, None, self.p.timeout_s)
            if said not in ("0", "1"):  # the store timed out or failed: no decision, not "not due"
                raise CheckpointError(f"rank 0's decision did not come: {said}")
            return said == "1"
        with self._decide_lock:
            now = time.monotonic()
            due = self._last_t is None or now - self._last_t >= (self.p.interval_s or 0.0)
            if due:
                self._last_t = now
            return decisions.persist_outcome(-step - 1, "1" if due else "0", 0) == "1"

    def _undecided(self, step: int, timeline: int) -> None:
        """Rank 0 gives up deciding ``step``: "not due", so no rank waits for its decision
        (first value wins: harmless where "due" was already told)."""
        if self.p.rank == 0:
            try:
                self.decisions.at(timeline).persist_outcome(-step - 1, "0", 0)
            except Exception:  # noqa: BLE001 - the store is gone: the others time out
                pass

    def failed_step(self, step: int, timeline: int = 0) -> None:
        """``step`` failed here (or this rank skipped it): with ``interval_s``, rank 0 marks
        it not due, so no rank waits for a decision that would never come; the other
        ranks' uploads of it stop waiting for this rank's shard (and, rank 0, for the gate)."""
        if self.p.interval_s is not None and self.p.rank == 0:
            self.decisions.at(timeline).persist_outcome(-step - 1, "0", 0)
        self._publish_failure(step, f"step {step} failed on rank {self.p.rank}", timeline)

    def _publish_failure(self, step: int, why: str, timeline: int) -> None:
        """Every rank learns at once that ``step`` gets no manifest (instead of waiting
        timeout_s for a count or a gate that will not come). First value wins."""
        try:
            coord = self.coord.at(timeline)
            if self.p.rank == 0:
                coord.persist_gate(step, f"fail:0:{why}", 0)
            coord.persist_outcome(step, f"fail:{self.p.rank}:{why}", 0)
        except Exception:  # noqa: BLE001 - the store is gone: they time out
            pass

    def _start(self, step: int, sidecar: bytes, buf: Any, size: int, done: Callable[[str | None], None],
               timeline: int, deciding: bool = False, acquired: bool = False) -> bool:
        """Start the upload; False if the previous one still runs, or a forced one waits
        for it (reported here if the step was ``deciding``, else by the caller). Nothing
        starts after cancel(). ``acquired``: the caller holds the upload lock already."""
        with self._fate:
            queued = self._forced is not None and not acquired
        if not acquired and (queued or not self._busy.acquire(blocking=False)):
            with self._fate:
                mine = not deciding or self._deciding.pop((timeline, step), None) is not None
            if not mine:  # cancel() reported it
                return True
            self.skipped += 1
            with self._fate:
                trouble, running, ran = self.trouble, self.uploading, time.monotonic() - self._began
                forced = self._forced
            took = f"; the last one took {self._last_took:.1f} s" if self._last_took is not None else ""
            stuck = self._last_took is not None and ran > max(5 * self._last_took, 30.0)
            if queued and forced is not None:
                log.info("incluster: rank %d skips the persistent save of step %d: step %d (persist=True) waits for "
                         "the upload of step %s, and uploads go in step order", self.p.rank, step, forced[1], running)
            elif trouble is not None and running != self._trouble_told:
                self._trouble_told = running
                log.warning("incluster: rank %d skips the persistent save of step %d: the upload of step %s is still "
                            "retrying after an error (%s)%s. Saves to the cluster's RAM go on; persistent saves are "
                            "skipped until it ends (counted, logged at INFO)", self.p.rank, step, running, trouble,
                            fix_for(trouble, self._folder) or "; the persistent tier may be down or unreachable")
            elif stuck and running != self._trouble_told:
                self._trouble_told = running
                log.warning("incluster: rank %d skips the persistent save of step %d: the upload of step %s has run "
                            "for %.0f s%s: the persistent tier is slow or not answering. Saves to the cluster's RAM "
                            "go on", self.p.rank, step, running, ran, took)
            elif self.skipped == 1:
                fix = ("raise persistent_interval_s" if self.p.interval_s else
                       "raise persistent_every, or use persistent_interval_s")
                log.warning("incluster: rank %d skips the persistent save of step %d: the upload of step %s is "
                            "still running (for %.1f s%s). Uploads take longer than the saves due are apart: %s "
                            "(later skips are logged at INFO, counted; close() uploads the newest step)",
                            self.p.rank, step, running, ran, took, fix)
            else:
                log.info("incluster: rank %d skips the persistent save of step %d: the upload of step %s is still "
                         "running, for %.1f s (%d skipped so far)", self.p.rank, step, running, ran, self.skipped)
            self._publish_failure(step, "skipped, previous upload still running", timeline)
            if deciding:
                self._report(done, "skipped: the previous upload was still running")
            return False

        began = time.monotonic()
        with self._fate:
            mine = not deciding or self._deciding.pop((timeline, step), None) is not None
            go = mine and not self._closed
            if go:
                self.uploading, self._cancelled, self._counted, self._done = step, False, False, done
                self._timeline = timeline
                self.trouble, self._completing, self._began = None, False, began
                if not deciding:  # a decided step is counted already
                    self._active += 1
        if not go:  # cancel() came first: the slot may be unmapped already
            self._busy.release()
            if mine and deciding:
                self._report(done, CANCELLED)
            elif mine:
                done(CANCELLED)
            return True

        def run() -> None:
            err = None
            try:
                err = self._upload(step, sidecar, buf, size, self.coord.at(timeline),
                                   self._waits_of_uploads().at(timeline))
            except BaseException as exc:  # noqa: BLE001 - reported, never raised into training
                err = f"{type(exc).__name__}: {exc}"
                del exc  # its frames hold views of the slot's mapping
                self._publish_failure(step, err[:300], timeline)
            finally:
                with self._fate:
                    self.uploading = None
                    cancelled = self._cancelled
                self._busy.release()
            if cancelled:  # cancel() reported it already; the slot is no longer read
                log.info("incluster: rank %d: the upload of step %d that close() gave up on ended (%s)",
                         self.p.rank, step, err or "uploaded; no manifest")
                self._report(None, None)
                return
            skipped = _skipped_elsewhere(err)
            if err is None:
                self._last_took, self._last_failure = time.monotonic() - began, ""  # a new failure is news again
            elif skipped is not None:  # another rank skipped it (its previous upload ran): not a failure
                err = skipped
                log.info("incluster: rank %d: the persistent save of step %d is %s", self.p.rank, step, err)
            else:
                self.failed += 1
                err = _words(err) + fix_for(err, self._folder)
                key = re.sub(r"\d+", "N", err)
                said, self._last_failure = self._last_failure == key, key
                if timeline >= AGAIN:  # close()'s catch-up: the run's newest step, always said
                    log.warning("incluster: close() could not upload step %d, the run's newest, to the persistent "
                                "tier (rank %d): %s; the tier's newest step stays the one before", step,
                                self.p.rank, err)
                else:
                    (log.info if said else log.warning)(  # the same failure again: once is enough
                        "incluster: persistent save of step %d failed on rank %d: %s", step, self.p.rank, err)
            self._report(done, err)

        threading.Thread(target=run, name=f"incluster-upload-{step}", daemon=True).start()
        return True

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        delay = 0.5
        for attempt in range(1, self.retries + 1):
            if self._cancelled:  # close() gave up on this upload: it touches the tier no more
                raise _Cancelled(CANCELLED)
            try:
                value = fn()
                self.trouble = None
                return value
            except (OSError, TimeoutError, ConnectionError) as exc:
                if attempt == self.retries or isinstance(exc, PermissionError):  # refused: no retry helps
                    raise
                self.trouble = f"{what}: {type(exc).__name__}: {exc}"
                log.info("incluster: %s failed (%s); retry %d in %.1f s", what, exc, attempt, delay)
                time.sleep(delay)
                delay *= 2
        return None

    def _upload(self, step: int, sidecar: bytes, buf: Any, size: int, coord: Coordinator, waits: Coordinator
                ) -> str | None:
        """``coord`` counts and publishes; ``waits`` waits (see :meth:`_waits_of_uploads`)."""
        d = step_dir(self.p.job, step)
        name = f"rank-{self.p.rank:05d}"
        view = memoryview(buf)[:size] if size else memoryview(b"")
        sc = json.loads(sidecar)
        if self.p.rank == 0:
            self._retry("opening the step in the persistent tier",
                        lambda: self.steps.open(step, loaded=self.loaded, again=self._timeline >= AGAIN,
                                                began=began_of(sc)))
            coord.persist_gate(step, "ok", 0)
        else:  # nothing is written before rank 0 found the step free to write
            gate = waits.persist_gate(step, None, self.p.timeout_s)
            if gate != "ok":
                return gate
        self._retry("shard upload", lambda: self.tier.write(f"{d}/{name}.safetensors", view))
        faults.check("upload", self.p.rank, step)
        self._retry("sidecar upload", lambda: self.tier.write(f"{d}/{name}.json", memoryview(sidecar)))
        info = json.dumps({"rank": self.p.rank, "size": size, "checksum": sc["checksum"]})
        with self._fate:  # past this point the step may be manifested: cancel() must know
            if self._cancelled:
                return CANCELLED
            self._counted = True
        if coord.persisted(step, info):
            self._completing = True
            infos = sorted((json.loads(i) for i in coord.persist_infos(step)), key=lambda i: i["rank"])
            manifest = {"format": "incluster-manifest", "version": 1, "job": self.p.job, "step": step,
                        "world_size": self.p.world_size, "ranks": infos, "created": time.time(), "run": self.p.run,
                        "lineage": sc.get("lineage", [0, 0, -1])}
            self._retry("manifest upload", lambda: self.tier.write(f"{d}/{MANIFEST}", memoryview(json.dumps(manifest).encode())))
            coord.persist_outcome(step, "ok", 0)
            try:
                self.steps.retention(step, self.p.keep)
            except Exception as exc:  # noqa: BLE001 - the step is manifested: only the clean-up failed
                log.warning("incluster: persistent retention after step %d failed (%s: %s); older steps stay "
                            "until the next one", step, type(exc).__name__, exc)
        value = waits.persist_outcome(step, None, self.p.timeout_s)
        return None if value == "ok" else value

    def cancel(self) -> str | None:
        """Shut-down: nothing starts after this. Give up on the upload that still runs,
        and on steps still awaiting their time-based decision, and report them as not
        persisted; returns what was reported, or None if nothing was pending. If this rank's
        shard was not yet counted, the upload writes no manifest when it ends, and every
        rank learns at once that the step fails; once counted, the other ranks may still
        complete the manifest, and the report says so."""
        with self._fate:
            self._closed = True
            undecided, self._deciding = self._deciding, {}
            forced, self._forced = self._forced, None
            step, done, timeline = self.uploading, self._done, self._timeline
            running = step is not None and not self._cancelled
            self._cancelled = True
            counted = self._counted and not self._completing  # the manifest writer's count is no promise
        undecided_why = None
        for (later_timeline, later), told in sorted(undecided.items()):
            self._undecided(later, later_timeline)
            self._publish_failure(later, CANCELLED, later_timeline)
            undecided_why = (f"close() came while step {later} (persist=True) waited for the upload before it to "
                             f"end: it is not in the persistent tier" if (later_timeline, later) == forced
                             else f"close() came before rank 0's clock said whether step {later} was due "
                                  f"(persistent_interval_s): it is not in the persistent tier")
            self._report(told, undecided_why)
        if not running or step is None:
            return undecided_why
        if counted:
            why = (f"the upload had not finished when close() ended it, after this rank's shard was uploaded and "
                   f"counted: the other ranks may still complete step {step}'s manifest (`incluster ls` shows "
                   f"whether they did)")
        else:
            why = (f"the upload had not finished when close() ended it; it writes no manifest, so step {step} is "
                   f"not in the persistent tier (its previous persistent step stands)")
            self._publish_failure(step, CANCELLED, timeline)
        if done is not None:
            done(why)
        return why

    def wait_idle(self, timeout: float) -> bool:
        """Whether no step is being decided or uploaded and every outcome was told (waits
        up to ``timeout``). Never takes the upload lock: a decision arriving meanwhile
        starts its upload."""
        with self._fate:
            return self._idle.wait_for(lambda: self._active == 0, timeout)
