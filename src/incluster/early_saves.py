"""Saves made while the writer process starts: none waits for that start.

The writer process starts in the background (a fresh interpreter importing torch, 1-7 s)
and the hand-offs of the saves made meanwhile queue for it (:mod:`incluster.handover`).
Each such save holds a slot. A save that finds every slot held by queued saves would
wait for the start and the first commit; instead the oldest queued save gives its slot up
(``_supersede``): it fails on every rank - nothing could be durable before that start, and
the newer steps supersede it - its FAIL told to the writer in its place in the queue.
``close()`` hands over what is still queued (``_hand_over_queued``).

Mixin of :class:`~incluster.checkpointer.Checkpointer`; ``_take_slot`` runs on the
trainer thread inside ``save()``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

from incluster.errors import CheckpointError, PeerTimeoutError
from incluster.handle import SaveHandle
from incluster.handover import SUPERSEDED, HandOver
from incluster.staging.engine import StageJob
from incluster.staging.slots import Slot, SlotRing

log = logging.getLogger("incluster")
POLL_S = 0.02  # how often a save waiting for a slot during the start looks for one to take


class EarlySaves:
    """Mixin: the saves made before the writer process has answered (see the module doc)."""

    rank: int
    ring: SlotRing
    config: Any
    _writer: Any
    _handover: HandOver
    _stage_pool: Any
    _said_superseded: bool
    # SavePipeline's (annotations only: a method here would shadow it in the Checkpointer)
    _tell_writer_failed: Callable[[int, str, tuple[int, int, int]], None]
    _fail: Callable[..., None]

    def _take_slot(self, step: int) -> Slot:
        """A slot for ``step`` (``SlotRing.acquire``). While the writer process starts, a
        save that finds every slot held by saves queued for that start takes the oldest
        one's - also when they are queued while it waits - rather than wait for the start."""
        deadline = time.monotonic() + self.config.slot_timeout_s
        while self._starting():
            if self._handover.waiting and step > self.ring.newest_step() and not self.ring.has_room():
                self._supersede(step)
            try:
                return self.ring.acquire(step, POLL_S)
            except PeerTimeoutError:
                if time.monotonic() >= deadline:
                    raise
        return self.ring.acquire(step, max(0.0, deadline - time.monotonic()))

    def _starting(self) -> bool:
        """Whether the current writer process has not answered its greeting yet."""
        started = getattr(self._writer, "started", None)
        return started is not None and not started.done()

    def _supersede(self, step: int) -> None:
        """save(``step``) finds every slot held by saves still waiting for the writer's
        start: the oldest of them gives its slot up, so save() does not wait for that start
        (1-7 s, a fresh interpreter importing torch). It fails, and the writer is told so
        in its place among the queued hand-offs (the steps' order holds); the other ranks
        fail it too, and the newer steps go on. Not once the start is over: the queue is then
        about to be handed over, and a slot freed by its commit."""
        if not self._starting():
            return

        def tell_instead(key: tuple[StageJob, SaveHandle]) -> Any:
            job = key[0]
            return functools.partial(self._tell_writer_failed, job.step, f"hand-off: {SUPERSEDED} (on rank "
                                     f"{self.rank}, by step {step})", (job.prev, job.ordinal, job.timeline))

        # A save(persist=True) (the run's last step, say) is given up only if every one is.
        key = self._handover.supersede(tell_instead, spare=lambda k: bool(k[0].persist))
        if key is None:
            return
        job, handle = key
        err = CheckpointError(
            f"step {job.step} was not saved ({SUPERSEDED}): save({step}) took its slot while it still waited for "
            f"this rank's writer process to start (a fresh interpreter importing torch), as saves came faster "
            f"than that start; the newer steps go on as usual"
            f"{' (and close() uploads the newest to the persistent tier)' if self.config.persistent else ''}. "
            f"Every slot held such a save: to keep every early step, wait for ckpt.prepare(state) after the "
            f"first optimizer step (it resolves once the writer's start is over) "
            f"or save less often in the first seconds of a run")
        err.from_peer = True  # type: ignore[attr-defined]  # wait() and the handle say it; no later save() raises it
        log.log(logging.INFO if self._said_superseded else logging.WARNING, "incluster: rank %d: %s%s", self.rank,
                err, "" if self._said_superseded else " (said once; later ones at INFO)")
        self._said_superseded = True
        self._fail(job, handle, err, "hand-off", published=True)

    def _hand_over_queued(self, deadline: float) -> None:
        """close(): what still waits for the writer's start (a refused save's FAIL, with
        no save pending) is handed over before the writer is shut down - the other ranks
        would wait ``slot_timeout_s`` for the step otherwise."""
        started = getattr(self._writer, "started", None)
        if not self._handover.waiting or started is None:
            return
        try:
            started.exception(max(0.0, deadline - time.monotonic()))  # the start's outcome, not its error
            self._stage_pool.submit(self._handover.flush).result(max(1.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - close() goes on
            log.warning("incluster: rank %d: close() could not hand the writer what waited for its start: %s",
                        self.rank, exc)
