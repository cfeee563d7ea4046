"""One live Checkpointer per job, rank and RAM folder.

Two runs that share a job name and ``local_dir`` would adopt, overwrite and recycle each
other's slots (one resumed the other's step, then both failed with a vanished staging
file). Each Checkpointer holds an exclusive lock on ``<local_dir>/<job>/.claim-<rank>``
for its lifetime: a POSIX record lock (``lockf``, not ``flock``), which the kernel drops
when the process dies (a SIGKILLed run never blocks its restart) and which processes
forked later (data-loader workers) do not inherit, so none keeps it after ``close()``. Within one process a table
of held claims does the same: a second Checkpointer there closes the earlier one first
(re-running a notebook cell leaves the last one open and out of reach). Another
process's claim is refused, naming who holds it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import sys
import threading
import weakref
from typing import Any

from incluster.errors import CheckpointError

log = logging.getLogger("incluster")
_PREFIX = ".claim-"
_held: dict[str, Any] = {}  # this process's claims -> weakref to their owner (record locks never conflict within a process)
_held_lock = threading.Lock()


def _forked() -> None:
    global _held_lock
    _held.clear()  # a forked child holds no record lock, so none of the parent's claims
    _held_lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


class Claim:
    def __init__(self, job_folder: str, job: str, rank: int, owner: Any = None) -> None:
        self.path = _path(job_folder, rank)
        self._fd: int | None = None
        where = f"job {job!r} rank {rank} is in use in {os.path.dirname(job_folder)} by "
        with _held_lock:
            ref = _held.get(self.path)
        earlier = ref() if ref is not None else None
        if earlier is not None and callable(getattr(earlier, "close", None)):
            # A Checkpointer re-made without closing the last (a notebook cell run again): two
            # in one process would write the same files, and the last one may be out of reach.
            log.warning("incluster: a new Checkpointer for job %r rank %d in this process: the earlier one, "
                        "still open, is closed first (its saves in flight are drained)", job, rank)
            earlier.close()
        with _held_lock:
            if self.path in _held:
                raise CheckpointError(where + "another Checkpointer of this process: close() it first")
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except OSError as exc:  # the folder exists, but this process may not write it
                raise CheckpointError(
                    f"cannot write this job's folder {job_folder} ({exc.strerror or exc}); point local_dir (or "
                    f"INCLUSTER_LOCAL_DIR) at a folder this process can write, in the node's RAM disk (e.g. "
                    f"/dev/shm/incluster), or give this run its own job=") from exc
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read(fd)
                os.close(fd)
                if exc.errno == errno.ENOLCK:  # a filesystem without record locks: no claim, as before
                    return
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise CheckpointError(
                    where + f"process {holder or '(unknown)'}: two runs with one job name would overwrite each "
                    f"other's checkpoints; give this run its own job= (or INCLUSTER_JOB) or local_dir, or stop "
                    f"the other") from None
            _held[self.path] = weakref.ref(owner) if owner is not None else (lambda: None)
            self._fd = fd
        me = f"{os.getpid()} on {socket.gethostname()} ({' '.join(sys.argv)[:200]})".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)

    def release(self) -> None:
        with _held_lock:
            if self._fd is not None:
                os.close(self._fd)  # the lock goes with it; the file stays (no unlink race)
                self._fd = None
                _held.pop(self.path, None)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _path(job_folder: str, rank: int) -> str:
    return os.path.realpath(os.path.join(job_folder, f"{_PREFIX}{rank:05d}"))


def claimed(job_folder: str, rank: int) -> bool:
    """Whether a live process holds ``rank``'s claim on ``job_folder`` (this one included)."""
    path = _path(job_folder, rank)
    with _held_lock:
        if path in _held:  # this very process: its record lock never conflicts with itself
            return True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False  # never claimed here
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EACCES, errno.EAGAIN)
    finally:
        os.close(fd)  # drops the probe's lock, if it got one (no other lock of this process is on it)
    return False


def refuse_shared_folder(job_folder: str, rank: int, node: str, run: str) -> None:
    """Two node names of one run writing one RAM folder (a ``local_dir`` on a shared
    filesystem, or two simulated nodes given the same one) would take each other's files
    for replicas and for their own: opaque commit failures, hangs. Each rank records its
    node under this run's id; a record of this run naming another node is refused, naming
    both. (Of two ranks starting at once, the later one to look sees the other's.)"""
    mine = os.path.join(job_folder, f"{_NODE}{rank:05d}")
    fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)  # never a link's target
    with os.fdopen(fd, "w") as f:
        f.write(f"{run}\n{node}\n")
    for name in os.listdir(job_folder):
        if not name.startswith(_NODE) or name == os.path.basename(mine):
            continue
        try:
            with open(os.path.join(job_folder, name)) as f:
                their_run, their_node = (f.read().split("\n") + ["", ""])[:2]
        except OSError:
            continue
        if their_run == run and their_node != node:
            raise CheckpointError(
                f"{job_folder} is written by node {their_node!r} (rank {name[len(_NODE):].lstrip('0') or '0'}) and "
                f"by node {node!r} (rank {rank}) of this run: each node needs a RAM folder of its own, or the nodes "
                f"take each other's files for copies. Point local_dir (INCLUSTER_LOCAL_DIR) at the node's own RAM "
                f"disk (e.g. /dev/shm/incluster), not a shared filesystem, or give ranks of one host one node name")


_NODE = ".node-"
