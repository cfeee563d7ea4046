"""Copies a node keeps for ranks that no longer save there.

After a restart with another layout (a spare in a failed node's place, ranks moved, fewer
ranks) a node's RAM folder still holds the folders the old layout put there: replicas of
ranks whose partners are now elsewhere, own shards of ranks now on other nodes. No ring
owns them, so no retention ever removes them, and each holds up to ``keep`` full shards.

One writer per node (the lowest rank there) removes them once the new layout has made two
steps durable: every copy in such a folder of a step older than the first of them goes
(the newest steps of every rank now live in the new layout's folders and replicas).
"""

from __future__ import annotations

import logging
import os
import re

from incluster.claim import claimed
from incluster.staging.slots import STAGING_PREFIX

log = logging.getLogger("incluster")
_STEP = re.compile(r"^step-(\d{12,})\.")
_RANK = re.compile(r"^rank-(\d{5,})$")


def sweep_orphans(local_dir: str, job: str, kept: tuple[int, ...], before: int) -> int:
    """Remove, from this node's folders of ``job`` whose rank is not in ``kept``, every
    file of a step older than ``before`` (sidecar first: a record never outlives its bytes
    half-way) and their unused staging files; an emptied folder goes too. Returns the
    number of steps removed."""
    base = os.path.join(local_dir, job)
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return 0
    removed, ranks = 0, []
    for n in sorted(names):
        m = _RANK.match(n)
        if m is None or int(m.group(1)) in kept:
            continue
        folder = os.path.join(base, n)
        if claimed(base, int(m.group(1))):
            continue  # that rank runs here after all (a RAM folder shared by several node names)
        try:
            files = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        old = {int(s.group(1)) for f in files if (s := _STEP.match(f)) and int(s.group(1)) < before}
        doomed = sorted((f for f in files if f.startswith(STAGING_PREFIX)
                         or ((s := _STEP.match(f)) is not None and int(s.group(1)) in old)),
                        key=lambda f: (not f.endswith(".json"), f))  # sidecars first
        for f in doomed:
            try:
                os.unlink(os.path.join(folder, f))
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
        removed += len(old)
        if old:
            ranks.append(int(m.group(1)))
        try:
            os.rmdir(folder)  # only if nothing else is left in it
        except OSError:
            pass
    if removed:
        log.info("incluster: removed %d old step(s) of rank(s) %s from %s: this node keeps no copies for them in "
                 "the current layout", removed, ranks, base)
    return removed

