"""A little space held back in the RAM disk, so that a full disk never blocks a save
that fits its slot.

Slot files are allocated once, so a save into a reused slot needs no new pages - except
for its commit record (the sidecar), which is a new file, written before the record of
the step it replaces is removed. On a RAM disk that something else filled up, that one
page is what fails. Each rank keeps a small file, ``<local_dir>/<job>/.reserve-<rank>``;
a sidecar write that hits ENOSPC removes one reserve file of the job on this node and
tries again, and the reserve is put back after a later commit, once space is free again.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Callable

log = logging.getLogger("incluster")
MIN_BYTES = 1 << 20  # far above any sidecar of a normal state; grown to 2x the largest seen
_PREFIX = ".reserve-"


def reserve_path(job_folder: str, rank: int) -> str:
    return os.path.join(job_folder, f"{_PREFIX}{rank:05d}")


def ensure(path: str, nbytes: int = MIN_BYTES) -> bool:
    """Hold ``nbytes`` (at least) in ``path``; best effort: False if there is no room."""
    nbytes = max(MIN_BYTES, nbytes)
    try:
        st = os.lstat(path)
        if st.st_size >= nbytes:
            return True
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError:
        os.ftruncate(fd, 0)  # no half reserve holding pages for nothing
        return False
    finally:
        os.close(fd)


def spend(job_folder: str, prefer_rank: int | None = None) -> bool:
    """Remove one reserve file of this job (this rank's first); False if none is left."""
    try:
        names = sorted(n for n in os.listdir(job_folder) if n.startswith(_PREFIX))
    except OSError:
        return False
    mine = f"{_PREFIX}{prefer_rank:05d}" if prefer_rank is not None else None
    names.sort(key=lambda n: n != mine)  # this rank's own reserve first
    for name in names:
        try:
            os.unlink(os.path.join(job_folder, name))
            log.warning("incluster: the RAM disk under %s is full; a commit record used the space held in reserve "
                        "(free space there: the next save may not fit)", job_folder)
            return True
        except FileNotFoundError:
            continue
    return False


def write_or_spend(write: Callable[[], None], job_folder: str, prefer_rank: int | None = None) -> None:
    """``write()``; on ENOSPC, spend a reserve file and try once more."""
    try:
        write()
    except OSError as exc:
        if exc.errno != errno.ENOSPC or not spend(job_folder, prefer_rank):
            raise
        write()
