"""Checkpointer options: validated, documented, and the one place INCLUSTER_* is read."""

from __future__ import annotations

import difflib
import hashlib
import inspect
import logging
import operator
import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from incluster.tiers.local import check_job

DEFAULT_LOCAL_DIR = "/dev/shm/incluster"
MAX_KEEP = 64  # steps kept in RAM per rank: each is a whole copy of the shard


@dataclass(frozen=True, kw_only=True)
class Config:
    """Resolved options of one Checkpointer (picklable: it crosses process boundaries)."""

    local_dir: str
    """Tier 0: this node's RAM-disk folder (``INCLUSTER_LOCAL_DIR``, default /dev/shm/incluster)."""
    job: str
    """Namespace of this job's files: ``INCLUSTER_JOB``, else torchrun's ``TORCHELASTIC_RUN_ID``
    (unless it is torchrun's default, "none", or a run id torchrun drew itself for a one-node
    job, new at every launch), else a name derived from the launch (see ``default_job``) -
    never one that unrelated runs share."""
    node: str
    """This node's identity (``INCLUSTER_NODE``, default the host name)."""
    keep: int = 2
    """Slot files per shard (>= 2); the newest complete step is never overwritten."""
    replicas: int = 1
    """Copies of each rank's shard kept in other nodes' RAM (0: in-node copies only)."""
    allow_pickle: bool = False
    """Store objects that are not tensors/JSON with pickle. Loading them can run code."""
    slot_timeout_s: float = 300.0
    """Longest wait for a free slot, for staging, or for a commit before an error."""
    fsync: bool = False
    """msync/fsync shards and sidecars (for a local_dir on a real disk; tmpfs needs none)."""
    run_dir: str | None = None
    """Folder for goodput event logs (``INCLUSTER_RUN_DIR``); None records nothing."""
    persistent: Any = None
    """Tier 2: a path or fsspec URL (s3://bucket/run, gs://..., /mnt/ckpt), or a Tier
    object (picklable when writer="process"); None = off."""
    persistent_every: int = 10
    """Every Nth local checkpoint also goes to the persistent tier: the 1st, the N+1st, ...
    of each run (counted again from a load()), so a run's first save is always there."""
    persistent_interval_s: float | None = None
    """Instead of every Nth: a persistent checkpoint at most this often. Rank 0's clock
    decides after its commit; the other writers learn it in the background, never in
    their commit path. The first save of a run persists."""
    persistent_keep: int = 2
    """Manifested steps kept in the persistent tier; older ones are deleted."""
    persistent_options: dict | None = None  # type: ignore[type-arg]
    """fsspec storage options, e.g. {"client_kwargs": {"endpoint_url": ...}} for S3."""
    gpu_snapshot: int | None = None
    """GPU state: bytes of device memory a reused device-side snapshot may take (the
    optimizer then waits ~1 ms/GiB for a device-to-device copy instead of PCIe). None:
    automatic, only memory the job never used so far; 0: off, copy device-to-host directly."""
    gpu_drain: str = "writer"
    """Who copies the device-side snapshot to host memory: "writer" (the writer process,
    through CUDA IPC: the training loop's own device-to-host copies, e.g. ``loss.item()``,
    never queue behind it) or "trainer" (a thread of the training process). "writer"
    needs writer="process"; otherwise the trainer drains."""
    share_replicas: bool = True
    """A replica whose bytes equal the partner's own shard of the same step (data-parallel
    ranks) is kept as the owner's sidecar pointing at that shard: no bytes sent, no RAM
    used twice. False: always a full copy (independent of the partner's file)."""
    reshard_rank_state: str = "same-rank"
    """A restore into a different world size: where each new rank's own values (those not
    cut by DTensor placements: plain tensors, data-loader position, RNG) come from.
    "same-rank": the old rank of the same number (a rank beyond the old world takes old
    rank ``rank % old_world``, and says so); "rank0": old rank 0 for every rank;
    "refuse": no restore into a different world size."""
    writer: str = "process"
    """Where commits run: "process" (a writer process per rank, no GIL contention with
    the trainer) or "thread" (a background thread; no extra process)."""

    def __post_init__(self) -> None:
        check_job(self.job)
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise ValueError(f"replicas must be an integer >= 0 (got {self.replicas!r})")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 2:
            raise ValueError(
                f"keep must be an integer >= 2 (got {self.keep!r}): one slot always holds the newest "
                f"complete step, so a save needs at least one more"
            )
        if self.keep > MAX_KEEP:
            raise ValueError(
                f"keep must be at most {MAX_KEEP} (got {self.keep!r}): each kept step is a whole copy of the "
                f"shard in the node's RAM; keep older steps in the persistent tier (persistent_keep)")
        for name in ("slot_timeout_s", "persistent_interval_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__} {value!r}")
        if not self.slot_timeout_s > 0:
            raise ValueError(f"slot_timeout_s must be > 0 (got {self.slot_timeout_s!r})")
        if not isinstance(self.persistent_every, int) or self.persistent_every < 1:
            raise ValueError(f"persistent_every must be an integer >= 1 (got {self.persistent_every!r})")
        if self.persistent_interval_s is not None and not self.persistent_interval_s > 0:
            raise ValueError(f"persistent_interval_s must be > 0 or None (got {self.persistent_interval_s!r})")
        if not isinstance(self.persistent_keep, int) or self.persistent_keep < 1:
            raise ValueError(f"persistent_keep must be an integer >= 1 (got {self.persistent_keep!r})")
        if self.gpu_snapshot is not None and (
            not isinstance(self.gpu_snapshot, int) or isinstance(self.gpu_snapshot, bool) or self.gpu_snapshot < 0
        ):
            raise ValueError(f"gpu_snapshot must be None (automatic), 0 (off) or a number of bytes (got {self.gpu_snapshot!r})")
        if self.gpu_drain not in ("writer", "trainer"):
            raise ValueError(f'gpu_drain must be "writer" or "trainer" (got {self.gpu_drain!r})')
        if not isinstance(self.share_replicas, bool):
            raise ValueError(f"share_replicas must be True or False (got {self.share_replicas!r})")
        if self.reshard_rank_state not in ("same-rank", "rank0", "refuse"):
            raise ValueError(
                f'reshard_rank_state must be "same-rank", "rank0" or "refuse" (got {self.reshard_rank_state!r})'
            )
        if self.writer not in ("process", "thread"):
            raise ValueError(f'writer must be "process" or "thread" (got {self.writer!r})')
        if not self.node or "/" in self.node:
            raise ValueError(f"node must be a non-empty name without '/' (got {self.node!r})")


def check_names(options: Mapping[str, Any], where: str) -> None:
    """Refuse an option :func:`resolve` does not take, naming the closest one."""
    known = [n for n in inspect.signature(resolve).parameters]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (options: {', '.join(known)})"
            raise TypeError(f"{where} got an unknown option {name!r}{hint}")


ENV_NAMES = ("INCLUSTER_LOCAL_DIR", "INCLUSTER_JOB", "INCLUSTER_NODE", "INCLUSTER_RUN_DIR", "INCLUSTER_PERSISTENT",
             "INCLUSTER_HASH_THREADS", "INCLUSTER_DRAIN_PIECE_MIB", "INCLUSTER_DRAIN_WINDOW",
             "INCLUSTER_FAULTS", "INCLUSTER_CAMPAIGN_KEEP", "INCLUSTER_TEST_FRESH_RANKS",
             "INCLUSTER_TEST_FRESH_WRITERS", "INCLUSTER_TEST_WRITER_SERVER")
_env_warned: set[str] = set()


def check_env() -> None:
    """Warn once about an INCLUSTER_* variable incluster does not read (a typo would
    silently fall back to the default, e.g. checkpoints in /dev/shm/incluster)."""
    import logging

    for name in os.environ:
        if name.startswith("INCLUSTER_") and name not in ENV_NAMES and name not in _env_warned:
            _env_warned.add(name)
            close = difflib.get_close_matches(name, ENV_NAMES, n=1)
            logging.getLogger("incluster").warning(
                "incluster: the environment variable %s is not one incluster reads%s (it reads %s)", name,
                f"; did you mean {close[0]}?" if close else "", ", ".join(ENV_NAMES[:5]))


def _path(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), not {type(value).__name__} {value!r}")
    if value is not None and not os.fspath(value):
        raise ValueError(f"{name} is an empty path; leave it out (None) for the default, or name a folder")


def _unused_tier_options(**given: Any) -> None:
    """Options of the persistent tier given without one: say so (once per option set), or
    a run believed to outlive its nodes would not."""
    names = [f"{k}={v!r}" for k, v in given.items() if v is not None]
    key = "tier:" + ",".join(names)
    if names and key not in _env_warned:
        _env_warned.add(key)
        logging.getLogger("incluster").warning(
            "incluster: %s given, but there is no persistent tier: no step leaves this cluster's RAM. Pass "
            "persistent=<path or URL> (or set INCLUSTER_PERSISTENT), or leave %s out", ", ".join(names),
            "it" if len(names) == 1 else "them")


def default_local_dir() -> str:
    """This node's RAM folder when ``local_dir`` is not given."""
    return os.path.expanduser(os.environ.get("INCLUSTER_LOCAL_DIR") or DEFAULT_LOCAL_DIR)


def resolve(
    *,
    local_dir: str | os.PathLike[str] | None = None,
    job: str | None = None,
    node: str | None = None,
    keep: int = 2,
    replicas: int = 1,
    allow_pickle: bool = False,
    slot_timeout_s: float = 300.0,
    fsync: bool = False,
    run_dir: str | os.PathLike[str] | None = None,
    writer: str = "process",
    gpu_snapshot: int | None = None,
    gpu_drain: str = "writer",
    reshard_rank_state: str = "same-rank",
    share_replicas: bool = True,
    persistent: Any = None,
    persistent_every: int | None = None,
    persistent_interval_s: float | None = None,
    persistent_keep: int = 2,
    persistent_options: dict | None = None,  # type: ignore[type-arg]
) -> Config:
    """Fill unset options from the environment, then validate."""
    if persistent_every is not None and persistent_interval_s is not None:
        raise ValueError(
            f"persistent_every={persistent_every!r} and persistent_interval_s={persistent_interval_s!r} each choose "
            f"the steps that go to the persistent tier (every Nth save, or at most one per interval); pass one")
    env = os.environ
    check_env()
    _path("local_dir", local_dir)
    _path("run_dir", run_dir)
    rd = run_dir if run_dir is not None else env.get("INCLUSTER_RUN_DIR")
    if persistent is None and not env.get("INCLUSTER_PERSISTENT"):
        _unused_tier_options(persistent_every=persistent_every, persistent_interval_s=persistent_interval_s,
                             persistent_keep=None if persistent_keep == 2 else persistent_keep,
                             persistent_options=persistent_options)
    return Config(
        local_dir=os.path.abspath(os.path.expanduser(os.fspath(local_dir or default_local_dir()))),
        job=job if job is not None else (env.get("INCLUSTER_JOB") or default_job()),
        node=node or env.get("INCLUSTER_NODE") or socket.gethostname(),
        keep=keep,
        replicas=replicas,
        allow_pickle=allow_pickle,
        slot_timeout_s=slot_timeout_s,
        fsync=fsync,
        run_dir=os.path.expanduser(os.fspath(rd)) if rd else None,
        writer=writer,
        gpu_snapshot=gpu_snapshot,
        gpu_drain=gpu_drain,
        reshard_rank_state=reshard_rank_state,
        share_replicas=share_replicas,
        persistent=_persistent_url(persistent if persistent is not None else env.get("INCLUSTER_PERSISTENT")),
        persistent_every=10 if persistent_every is None else persistent_every,
        persistent_interval_s=persistent_interval_s,
        persistent_keep=persistent_keep,
        persistent_options=persistent_options,
    )


def default_job() -> str:
    """The job name when none is given: torchrun's run id if it set a real one; otherwise
    the training script's name plus a digest of what identifies this launch - for a
    multi-node job the rendezvous endpoint (MASTER_ADDR:MASTER_PORT, the same on every
    rank), for a single process or a one-node job the script's absolute path and the
    working directory. A restart of the same launch resumes; a different script, folder
    or endpoint never shares (or loads) another run's checkpoints because the shapes
    happen to match. A run id torchrun drew for a one-node job (:func:`drawn_run_id`) is
    new at every launch, so it names nothing a relaunch could find: not used."""
    env = os.environ
    rid = env.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none" and not drawn_run_id():
        return rid if _JOB_SAFE.match(rid) else "run-" + hashlib.blake2b(rid.encode(), digest_size=6).hexdigest()
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.splitext(os.path.basename(main))[0]) if main else "interactive"
    if int(env.get("WORLD_SIZE", "1") or "1") > 1 and not _one_node():
        key = f"{stem}|{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    else:
        key = f"{os.path.abspath(main) if main else ''}|{os.getcwd()}"
    return f"{stem.lstrip('._-')[:64] or 'run'}-{hashlib.blake2b(key.encode(), digest_size=4).hexdigest()}"


_JOB_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _one_node() -> bool:
    env = os.environ
    return bool(env.get("LOCAL_WORLD_SIZE")) and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE", "1")


def drawn_run_id() -> bool:
    """Whether torchrun's run id is one it drew for this launch: a UUID on a one-node job.
    torchrun draws one for ``--standalone``, and (torch 2.13) for any one-node launch
    without ``--rdzv-endpoint`` or ``--master-port``, ignoring ``--rdzv-id`` then."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    return bool(rid and _UUID.match(rid)) and _one_node()


def _persistent_url(value: Any) -> Any:
    """A plain path becomes absolute, ``~`` expanded (every rank and the writer agree on
    it); URLs and Tier objects stay as they are."""
    from incluster.tiers.base import Tier

    if isinstance(value, Tier):
        return value
    if not value:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"persistent must be a path, a URL (s3://bucket/prefix) or an incluster Tier, not "
            f"{type(value).__name__} {value!r}"
        )
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"persistent must be a str path or URL, not {type(text).__name__} {text!r}")
    from incluster.tiers.persistent import check_url

    check_url(text)  # a one-slash URL or an unknown protocol: refused here, not written to ./s3:/...
    # "~" as the shell would: a folder named "~" under the working directory would be another
    # tier for a relaunch from another folder, which then found nothing and started afresh
    return text if "://" in text else os.path.abspath(os.path.expanduser(text))


def step_number(step: Any) -> int:
    """``step`` as a plain int: any integer type (a numpy or 0-dim integer tensor counter
    too), never a bool, a float or a negative number."""
    if (not isinstance(step, bool) and str(getattr(step, "dtype", "")) not in ("bool", "torch.bool")
            and getattr(step, "ndim", 0) == 0):
        try:
            number = operator.index(step)
        except TypeError:
            pass
        else:
            if number >= 0:
                return number
    raise ValueError(f"step must be a non-negative int (got {step!r})")
