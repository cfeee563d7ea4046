"""A writer on background threads of the trainer process (``writer="thread"``).

Checksumming runs in xxhash's C code with the GIL released, so the trainer's Python
thread keeps running; the file operations are a few syscalls per save. One thread
commits, another waits for global outcomes, so a slow peer never delays a local commit.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from incluster.errors import CheckpointError
from incluster.staging.slots import Slot
from incluster.writer.local_commit import CommitRequest
from incluster.writer.protocol import WriterParams
from incluster.writer.service import CommitService


class ThreadWriter:
    pid = None

    def __init__(self, params: WriterParams) -> None:
        self._service = CommitService(params)
        self._commit = ThreadPoolExecutor(1, thread_name_prefix="incluster-writer")
        self._watch = ThreadPoolExecutor(1, thread_name_prefix="incluster-outcome")

    def submit(self, req: CommitRequest, slot: Slot) -> "tuple[Future[str], Future[None]]":
        if slot.mm is None and req.size:
            raise CheckpointError(f"slot {slot.index} is not mapped; it cannot be committed")
        local = self._commit.submit(self._service.commit, req, slot.mm if slot.mm is not None else b"")
        outcome: Future[None] = Future()

        def chain(f: "Future[str]") -> None:
            if f.exception() is not None:
                outcome.set_exception(f.exception())  # type: ignore[arg-type]
                return
            try:
                w = self._watch.submit(self._service.wait_outcome, req.step)
            except RuntimeError:  # closed while this commit was finishing
                outcome.set_exception(CheckpointError(f"the writer closed before step {req.step}'s outcome"))
                return
            w.add_done_callback(lambda g: outcome.set_exception(g.exception()) if g.exception() else outcome.set_result(None))  # type: ignore[arg-type]

        local.add_done_callback(chain)
        return local, outcome

    def fail(self, step: int, reason: str) -> None:
        self._service.fail(step, reason)

    def close(self, timeout: float) -> None:
        self._commit.shutdown(wait=True)
        self._watch.shutdown(wait=True)
        self._service.close()
