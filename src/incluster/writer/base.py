"""The writer interface the Checkpointer uses, whatever runs it (thread or process)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from incluster.staging.slots import Slot
from incluster.writer.local_commit import CommitRequest


class Writer(Protocol):
    pid: int | None

    @property
    def dead(self) -> BaseException | None:
        """Why the writer is gone (a process writer that died); None while it works."""
        ...

    def submit(self, req: CommitRequest, slot: Slot) -> "tuple[Future[tuple[str, bool]], Future[None]]":
        """Commit a staged slot. Futures: the local commit (shard path) and the global
        outcome (done when every rank committed the step; CommitError if one failed).
        The local future gives (shard path, whether this step goes to the persistent tier)."""
        ...

    def fail(self, step: int, reason: str, seq: tuple[int, int, int] | None = None) -> None:
        """Publish that this rank's save of ``step`` failed (so no rank waits for it).
        ``seq``: the save's (prev, ordinal, timeline), as in CommitRequest."""
        ...

    def replicate(self, folder: str, step: int) -> None:
        """Re-send a restored step's replicas in the background (every rank's writer)."""
        ...

    def persist_again(self, folder: str, step: int, timeline: int) -> None:
        """Upload this rank's committed shard of ``step`` (saved after ``timeline`` loads)
        now, whatever the schedule; every rank asks alike. The word comes as for any
        upload, with the timeline ``protocol.AGAIN + timeline``. The caller pins its slot."""
        ...

    def close(self, timeout: float) -> None:
        """Finish what was submitted, then stop."""
        ...
