"""SaveHandle: what ``Checkpointer.save`` returns, two futures and the save's timings."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from incluster.errors import PeerTimeoutError


@dataclass(eq=False)
class SaveHandle:
    """A save in flight.

    ``staged``: the bytes are copied out; the state may be mutated again.
    ``durable``: committed in the cluster: every rank's shard and its replicas.
    ``persisted``: True once this step is in the persistent tier's manifest; False when
    it is not a persistent step (or its upload was skipped); TierUnavailableError when the
    upload failed (training goes on; the next persistent step tries again).
    Timings are seconds from the ``save()`` call; ``None`` until reached: ``blocked_s``
    (``save()`` returned), ``staged_s``, ``drained_s`` (the writer process finished
    reading the device-side snapshot: GPU saves it drains only), ``committed_s`` (this
    rank's shard committed on its node), ``durable_s``.
    """

    step: int
    staged: "Future[None]" = field(default_factory=Future)
    durable: "Future[None]" = field(default_factory=Future)
    persisted: "Future[bool]" = field(default_factory=Future)
    started: float = field(default_factory=time.perf_counter)
    blocked_s: float | None = None
    staged_s: float | None = None
    drained_s: float | None = None
    committed_s: float | None = None
    durable_s: float | None = None
    reported: bool = False  # its error reached the caller; the Checkpointer won't raise it again
    skip_word: str | None = None  # why ``persisted`` is False: the upload's "skipped: ..." word
    deadline_s: float | None = None  # wait() without a timeout gives up this long after save()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until staged; raises the staging error if there was one."""
        self._result(self.staged, timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until durable; raises the save's error if there was one."""
        self._result(self.durable, timeout)

    def _result(self, fut: "Future[None]", timeout: float | None) -> None:
        bounded = timeout is None and self.deadline_s is not None
        if bounded:
            timeout = max(0.0, self.started + float(self.deadline_s) - time.perf_counter())  # type: ignore[arg-type]
        try:
            fut.result(timeout)
        except TimeoutError:
            if bounded:
                self.reported = True
                what = "staged" if fut is self.staged else "durable"
                raise PeerTimeoutError(
                    f"step {self.step} is not {what} {self.deadline_s:.0f} s after save(): this rank's writer "
                    f"or a peer stopped answering (see the log); raise slot_timeout_s if saves are "
                    f"legitimately this slow"
                ) from None
            raise
        except BaseException:
            self.reported = True  # the caller has it: the Checkpointer won't raise it again
            raise

    def done(self) -> bool:
        return self.durable.done()

    def __repr__(self) -> str:
        if self.durable.cancelled():
            state = "cancelled"
        elif self.durable.done() and self.durable.exception() is not None:
            state = f"failed: {type(self.durable.exception()).__name__}"
        else:
            state = "durable" if self.durable.done() else "staged" if self.staged.done() else "staging"
        return f"SaveHandle(step={self.step}, {state})"
