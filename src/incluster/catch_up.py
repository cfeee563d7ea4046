"""``close()`` catching the persistent tier up with the run's newest durable step.

One upload runs at a time per rank, and a due save that comes while it runs is skipped:
a run whose uploads are slower than its saves are apart (an object store's client
starting on the first, a slow link) could end with the tier far behind - even at its
first step - while the cluster's RAM, gone with the job's nodes, held newer ones. So
``close()`` uploads the newest durable step when

- the newest due step's upload was skipped (every rank learns the same outcome from the
  job store: a skip on one rank is published to all; with ``persistent_interval_s``, the
  newest save whose word was not "not due"), or
- ``persist_last`` is set (the integrations set it) and the tier does not have it, or
- a save was given up for a newer one while a writer process started (``saving._supersede``;
  the step fails on every rank with one marker): its upload, due or not, may be the one
  the tier lacks - a run shorter than that start kept nothing there before.

Every rank decides from the same facts - which steps were due, which are durable, each
upload's published outcome - so every rank uploads its shard, or none does. An upload
that failed, or whose word does not come within half of close()'s wait, adds nothing (a
failing tier gets no more uploads; close() stays within ``slot_timeout_s``). The slot of
that step stays put (no save runs during close()) and is pinned until the upload ends;
the writer uploads it from the committed files in job-store keys of its own, never
removing a manifest of it (``TierSteps.open``), and ``close()`` waits for it like any
upload. Limits: a rank whose word comes later than another's (an upload longer than half
of ``slot_timeout_s``), or whose close() raises an earlier failure, decides alone; the
others' catch-up then waits for its shard until close() gives up (bounded, no manifest).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from incluster.handle import SaveHandle
from incluster.persist import NOT_DUE
from incluster.staging.slots import SlotState

log = logging.getLogger("incluster")


def catch_up(ckpt: Any, deadline: float) -> SaveHandle | None:
    """After ``wait()`` in close(): start the upload the tier lacks, if any; its handle.
    Decided only from words every rank gets alike: a due upload skipped (published by the
    rank that skipped it), a step not due. An upload that failed, or whose word has not come
    by ``deadline`` (close()'s own, shared with the writer's close), adds nothing: a failing
    tier gets no more uploads, and close() stays within ``slot_timeout_s``."""
    if ckpt.config.persistent is None or ckpt._newest_durable is None:
        return None
    timeline, step, handle = ckpt._newest_durable
    due = ckpt._newest_due
    asked = ckpt.persist_last or ckpt._given_up
    if due is None and not asked:
        return None
    # Half of close()'s wait at most: the rest is the writer's, for the uploads in flight.
    grace = time.monotonic() + (deadline - time.monotonic()) / 2
    if not (handle.persisted.done() and (due is None or due[2].persisted.done())):
        log.info("incluster: rank %d: close() waits up to %.0f s for the word of the persistent upload in flight",
                 ckpt.rank, max(0.0, grace - time.monotonic()))
    due_word = _word(due[2], grace) if due is not None else False
    if due is not None and not_due(due[2]):
        # persistent_interval_s: every save is a candidate, decided when its upload would
        # start; the newest was not due. The newest one that was due says what the tier has.
        # Words come in any order (a skip is published before it is told): newest first.
        for cand in reversed(list(ckpt._candidates)):
            word = _word(cand[2], grace)
            if not not_due(cand[2]):  # uploaded, skipped, failed, or no word by the deadline
                due, due_word = cand, word
                break
        else:  # older than the candidates kept: their words came long ago
            due = ckpt._newest_due_word
            due_word = _word(due[2], grace) if due is not None else False
    if due_word is None:
        return None  # the newest due upload failed, or its word did not come: no more uploads to that tier
    skipped = due is not None and due_word is False and not not_due(due[2])
    if _word(handle, grace) is not False or not (skipped or asked):
        return None  # in the tier already, failed, no word; or nothing asks for it
    slot = next((s for s in ckpt.ring.slots if s.step == step and s.state is SlotState.COMMITTED), None)
    if slot is None:  # the newest durable step is never reused; a load() since may have dropped it
        log.warning("incluster: rank %d: close() cannot find step %d in its slots; the persistent tier stays at "
                    "what it has", ckpt.rank, step)
        return None
    from incluster.writer.protocol import AGAIN

    again = SaveHandle(step=step)
    with ckpt._lock:
        ckpt._uploads[(AGAIN + timeline, step)] = (slot, again)
        ckpt.ring.set_uploading(slot, True)
    why = (f"the upload of step {due[1]}, the newest due, was skipped" if skipped and due is not None
           else "persist_last is set")
    log.info("incluster: rank %d: close() uploads step %d to the persistent tier (%s)", ckpt.rank, step, why)
    ckpt._writer.persist_again(ckpt.folder, step, timeline)
    return again


def not_due(handle: SaveHandle) -> bool:
    """The save's upload word came and said "not due" (``persisted`` False with no skip)."""
    f = handle.persisted
    return (f.done() and not f.cancelled() and f.exception() is None and f.result() is False
            and (handle.skip_word or NOT_DUE) == NOT_DUE)


def _word(handle: SaveHandle, deadline: float) -> bool | None:
    """The upload's word (True: in the tier, False: skipped or not due), None if it failed
    or did not come by ``deadline``."""
    try:
        return handle.persisted.result(max(0.0, deadline - time.monotonic()))
    except (concurrent.futures.TimeoutError, Exception):  # noqa: BLE001 - failed, or no word yet
        return None
