"""A writer on background threads of the trainer process (``writer="thread"``).

Checksumming runs in xxhash's C code with the GIL released, so the trainer's Python
thread keeps running; the file operations are a few syscalls per save. One thread
commits, one exchanges replicas (in step order), another waits for global outcomes, so a
slow peer never delays a local commit.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from incluster.errors import CheckpointError, StoreLostError
from incluster.staging.slots import Slot
from incluster.writer.local_commit import CommitRequest
from incluster.writer.protocol import WriterParams
from incluster.writer.service import CommitService

log = logging.getLogger("incluster")


class ThreadWriter:
    pid: int | None = None
    dead: BaseException | None = None  # a thread writer dies only with the trainer

    def __init__(self, params: WriterParams, on_persisted: Any = None) -> None:
        self._on_persisted = on_persisted
        self._service = CommitService(params)
        self._commit = ThreadPoolExecutor(1, thread_name_prefix="incluster-writer")
        self._repl = ThreadPoolExecutor(1, thread_name_prefix="incluster-replicate")
        self._watch = ThreadPoolExecutor(1, thread_name_prefix="incluster-outcome")
        # a step the others saved and this rank skipped: take part in its exchange, sending nothing
        self._service.on_skipped = self._exchange_skipped

    def submit(self, req: CommitRequest, slot: Slot) -> "tuple[Future[tuple[str, bool]], Future[None]]":
        if slot.mm is None and req.size:
            raise CheckpointError(f"slot {slot.index} is not mapped; it cannot be committed")
        local: Future[tuple[str, bool]] = Future()
        outcome: Future[None] = Future()
        self._commit.submit(self._run, req, slot.mm if slot.mm is not None else b"", local, outcome)
        return local, outcome

    def _run(self, req: CommitRequest, buf: object, local: "Future[tuple[str, bool]]", outcome: "Future[None]") -> None:
        """Commit thread: local commit, then hand replication (and after it the outcome
        wait) to the replication thread."""
        try:
            path, own, persist = self._service.commit(req, buf)
        except BaseException as exc:  # noqa: BLE001 - delivered through the futures
            local.set_exception(exc)
            outcome.set_exception(exc)
            if self._service.exchanged(req.step, req.place):  # partners must not wait
                self._repl.submit(self._replicate, req.step, None, req.timeline)
            return
        local.set_result((path, persist))
        if persist and not self._service.upload(req.step, own, lambda err: self._persisted(req.step, err, req.timeline),
                                                req.timeline, forced=req.persist is True):
            self._persisted(req.step, "skipped: the previous upload was still running", req.timeline)
        self._repl.submit(self._replicate_then_watch, req.step, own, outcome, req.timeline)

    def _replicate_then_watch(self, step: int, own: object, outcome: "Future[None]", timeline: int) -> None:
        self._replicate(step, own, timeline)
        try:
            self._watch.submit(self._await, step, outcome, timeline)
        except RuntimeError:  # closed while this commit was finishing
            outcome.set_exception(CheckpointError(f"the writer closed before step {step}'s outcome"))

    def _persisted(self, step: int, err: str | None, timeline: int) -> None:
        if self._on_persisted is not None:
            self._on_persisted(step, err, timeline)

    def _replicate(self, step: int, own: object, timeline: int | None = None) -> None:
        """``timeline``: the step's load() count (None: the newest save's), which keys it in
        the job store."""
        try:
            self._service.replicate(step, own, timeline)
        except Exception:  # noqa: BLE001 - published as the step's failure; the outcome says so
            pass

    def _await(self, step: int, outcome: "Future[None]", timeline: int) -> None:
        try:
            self._service.wait_outcome(step, timeline)
            self._service.on_outcome(step)
        except BaseException as exc:  # noqa: BLE001
            if not isinstance(exc, StoreLostError):  # outcome unknown: the replicas held here stay
                self._service.on_failed(step)
            outcome.set_exception(exc)
            return
        outcome.set_result(None)

    def replicate(self, folder: str, step: int) -> None:
        """Re-send ``step``'s replicas in the background (after a restore)."""

        def run() -> None:
            try:
                self._service.replicate_committed(folder, step)
            except Exception as exc:  # noqa: BLE001 - the next save replicates anyway
                log.warning("incluster: re-replication of step %d failed: %s", step, exc)

        self._commit.submit(self._repl.submit, run)  # in order behind commits in flight

    def persist_again(self, folder: str, step: int, timeline: int) -> None:
        from incluster.writer.protocol import AGAIN

        self._service.upload_committed(folder, step, timeline, lambda err: self._persisted(step, err, AGAIN + timeline))

    def fail(self, step: int, reason: str, seq: tuple[int, int, int] | None = None) -> None:
        self._service.fail(step, reason, None if seq is None else seq[2])
        try:
            # Partners must not wait for us; queued behind commits in flight, so steps are
            # exchanged in order.
            self._commit.submit(self._failed_in_order, step, seq)
        except RuntimeError:
            pass

    def _exchange_skipped(self, step: int, timeline: int) -> None:
        self._repl.submit(self._replicate, step, None, timeline)

    def _failed_in_order(self, step: int, seq: tuple[int, int, int] | None) -> None:
        if self._service.exchanged(step, seq):
            self._repl.submit(self._replicate, step, None, None if seq is None else seq[2])

    def close(self, timeout: float) -> None:
        self._commit.shutdown(wait=True)
        self._repl.shutdown(wait=True)
        self._watch.shutdown(wait=True)
        self._service.close(timeout)
