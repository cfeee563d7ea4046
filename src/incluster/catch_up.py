"""``close()`` catching the persistent tier up with the run's newest durable step.

One upload runs at a time per rank, and a due save that comes while it runs is skipped:
a run whose uploads are slower than its saves are apart (an object store's client
starting on the first, a slow link) could end with the tier far behind - even at its
first step - while the cluster's RAM, gone with the job's nodes, held newer ones. So
``close()`` uploads the newest durable step when

- the newest due step's upload was skipped (every rank learns the same outcome from the
  job store: a skip on one rank is published to all), or
- ``persist_last`` is set (the integrations set it) and the tier does not have it.

Every rank decides from the same facts - which steps were due, which are durable, each
upload's published outcome - so every rank uploads its shard, or none does. The slot of
that step stays put (no save runs during close()) and is pinned until the upload ends;
the writer uploads it from the committed files in job-store keys of its own, and
``close()`` waits for it like any upload (up to ``slot_timeout_s``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from incluster.handle import SaveHandle
from incluster.staging.slots import SlotState

log = logging.getLogger("incluster")


def catch_up(ckpt: Any) -> SaveHandle | None:
    """After ``wait()`` in close(): start the upload the tier lacks, if any; its handle."""
    if ckpt.config.persistent is None or ckpt._newest_durable is None:
        return None
    timeline, step, handle = ckpt._newest_durable
    due = ckpt._newest_due
    deadline = time.monotonic() + ckpt.config.slot_timeout_s  # one wait for both words (a hung tier: none)
    outcome = _outcome(due[2], deadline) if due is not None else None
    mine = _outcome(handle, deadline)
    if mine is True:
        return None  # the newest durable step is in the tier
    skipped = due is not None and outcome is False
    if not (skipped or ckpt.persist_last):
        return None
    slot = next((s for s in ckpt.ring.slots if s.step == step and s.state is SlotState.COMMITTED), None)
    if slot is None:  # cannot happen on a live ring (the newest durable step is never reused)
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


def _outcome(handle: SaveHandle, deadline: float) -> bool | None:
    """The upload's word (True: in the tier, False: skipped or not due), None if it failed
    or did not come by ``deadline``: close() then adds no upload to a failing tier."""
    try:
        return handle.persisted.result(max(0.0, deadline - time.monotonic()))
    except (concurrent.futures.TimeoutError, Exception):  # noqa: BLE001 - a failed upload: no catch-up
        return None
