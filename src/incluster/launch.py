"""Who this process is in its launch: its rank and world (refusing a multi-rank launch
without a process group), whether its job's name was derived from the launch (and the
words a user needs when that name will not survive a relaunch), the exit hook that
finishes saves in flight, and the refusal of linked folders."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Mapping

import torch

from incluster.errors import CheckpointError

if TYPE_CHECKING:
    from incluster.checkpointer import Checkpointer

log = logging.getLogger("incluster")


def rank_world() -> tuple[int, int]:
    """(rank, world size): the process group's, else 0 of 1 for a single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1") or "1")
    except ValueError:
        launched = 1
    if launched > 1:  # every rank would write as rank 0 of 1, into the same folder
        raise CheckpointError(
            f"this process is one of {launched} ranks (WORLD_SIZE={launched}, RANK="
            f"{os.environ.get('RANK', '?')}) but torch.distributed is not initialized; call "
            f"torch.distributed.init_process_group() before creating the Checkpointer"
        )
    return 0, 1




def close_at_exit(ckpt: Checkpointer) -> None:
    """A script that ends without ``close()`` must not lose the save it just made (it did,
    without a word): at interpreter exit, before the thread pools' own exit hooks shut
    them down, the Checkpointer drains what is in flight, and says so.
    Holds the Checkpointer weakly: one that was dropped or closed, or has nothing in
    flight, is not touched. Only in the process that made it: multiprocessing's forked
    children (DataLoader workers) run these hooks too when they end."""
    ref = weakref.ref(ckpt)
    owner = os.getpid()

    def drain() -> None:
        if os.getpid() != owner:  # a forked child (a DataLoader worker) ending: not its saves
            return
        c = ref()
        if c is None or c._closed:
            return
        with c._lock:
            pending = [h.step for h in c._pending if not h.durable.done()]
        # a FAIL still queued for the writer's start: the other ranks wait for it otherwise
        if not pending and not c._handover.waiting:  # nothing to lose: the writer process follows its trainer out
            check_out_at_exit(c)
            return
        log.warning("incluster: rank %d exits without Checkpointer.close(); finishing the save(s) of step(s) "
                    "%s first (call close() at the end of training)", c.rank, pending)
        try:
            c.close()
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say what was lost
            log.warning("incluster: rank %d: saves in flight at exit did not complete: %s", c.rank, exc)

    register = getattr(threading, "_register_atexit", atexit.register)  # before the pools' own exit hooks
    try:
        register(drain)
    except RuntimeError:  # the interpreter is exiting already
        atexit.register(drain)


def check_out_at_exit(ckpt: Checkpointer) -> None:
    """A rank leaving without close() and with nothing in flight (an exception in the
    training code, say) still checks out of the job store, as close() does: rank 0, which
    hosts the store, waits at its own close() for every rank to check out (so the store
    outlives their drains), and waited ``slot_timeout_s`` for this one. Rank 0 itself
    leaves at once, as before: nothing of its own is in flight."""
    address = getattr(ckpt, "_store_address", None)
    if ckpt.rank == 0 or address is None or ckpt._checked_out:
        return
    ckpt._checked_out = True  # a close() after this (an atexit hook of the user's) checks out no more
    from incluster import wiring
    from incluster.writer.sequence import EXITED

    # As close() does, marking its last save first: a step the others save next fails at once.
    wiring.release_store(None, address, ckpt.config, ckpt.rank, ckpt.world_size, (ckpt._loads, ckpt._last_step),
                         how=EXITED)


def job_derived(options: Mapping[str, Any], job: str, world_size: int) -> bool:
    """Rank 0: whether ``job`` came from the launch (no job= or INCLUSTER_JOB); says so,
    and warns where the launch gives no name that a relaunch would find again."""
    from incluster.config import drawn_run_id

    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    drawn = drawn_run_id()  # anew at every launch: not the name
    derived = bool(not options.get("job") and not os.environ.get("INCLUSTER_JOB")
                   and (not rid or rid == "none" or drawn))
    if derived and drawn:
        log.info("incluster: job %r is named from the script and working directory: torchrun drew run id %s for "
                 "this one-node launch (it draws one at every launch unless given --rdzv-endpoint or "
                 "--master-port, ignoring --rdzv-id), so a relaunch of this script from here resumes it; pass "
                 "job= or set INCLUSTER_JOB to name it", job, rid)
    elif derived and rid == "none" and world_size > 1:
        log.info("incluster: job %r is named from the script and the rendezvous endpoint MASTER_ADDR:MASTER_PORT "
                 "(torchrun's run id is 'none'): a relaunch with the same endpoint resumes it; pass --rdzv-id "
                 "NAME to torchrun, or job= / INCLUSTER_JOB, to name it", job)
    elif derived:
        log.info("incluster: job %r (derived from the launch; pass job= or set INCLUSTER_JOB to "
                 "name it, e.g. to resume it from another launch)", job)
    return derived


def refuse_links(*folders: str) -> None:
    """The job's folders are never symbolic links: nothing is read or written elsewhere."""
    for f in folders:
        if os.path.islink(f):
            raise CheckpointError(
                f"{f} is a symbolic link (to {os.readlink(f)!r}); incluster never follows links in its "
                f"checkpoint folders - remove the link, or point local_dir at the real folder"
            )
