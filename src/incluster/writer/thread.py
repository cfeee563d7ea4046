"""A writer on a background thread of the trainer process.

Checksumming runs in xxhash's C code with the GIL released, so the trainer's Python
thread keeps running; the file operations are a few syscalls per save.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from incluster.errors import CheckpointError
from incluster.format.sidecar import Sidecar
from incluster.staging.slots import Slot
from incluster.writer.local_commit import CommitRequest, commit_shard


class ThreadWriter:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="incluster-writer")

    def submit(self, req: CommitRequest, slot: Slot) -> "Future[tuple[str, Sidecar]]":
        if slot.mm is None and req.size:
            raise CheckpointError(f"slot {slot.index} is not mapped; it cannot be committed")
        buf = slot.mm if slot.mm is not None else b""
        return self._pool.submit(commit_shard, req, buf)

    def close(self, timeout: float) -> None:
        self._pool.shutdown(wait=True)
