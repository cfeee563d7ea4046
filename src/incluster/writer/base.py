"""The writer interface the Checkpointer uses, whatever runs it (thread or process)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from incluster.format.sidecar import Sidecar
from incluster.staging.slots import Slot
from incluster.writer.local_commit import CommitRequest


class Writer(Protocol):
    def submit(self, req: CommitRequest, slot: Slot) -> "Future[tuple[str, Sidecar]]":
        """Commit a staged slot; the future holds the shard path and its sidecar."""
        ...

    def close(self, timeout: float) -> None:
        """Finish what was submitted, then stop."""
        ...
