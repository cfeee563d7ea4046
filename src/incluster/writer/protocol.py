"""Typed messages between a trainer and its writer, each tagged with a generation id.

A reply whose generation is not the writer's current one is stale (from a writer of an
earlier Checkpointer in the same process) and is dropped, never applied to a new save.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from incluster.commit import StoreAddress
from incluster.persist import AGAIN, PersistParams  # noqa: F401 - AGAIN: the writers' name for it


HEARTBEAT_S = 1.0  # how often a writer process says it is alive
STALL_S = 30.0  # a writer that sends nothing at all for this long is stopped or hung: killed, replaced


class Kind(enum.Enum):
    HELLO = "hello"  # trainer -> writer: WriterParams; writer -> trainer: its pid
    COMMIT = "commit"  # trainer -> writer: a CommitRequest
    FAIL = "fail"  # trainer -> writer: publish that a step failed on this rank
    SHUTDOWN = "shutdown"  # trainer -> writer: finish outstanding work, then exit
    REPLICATE = "replicate"  # trainer -> writer: re-send a restored step's replicas (payload: folder)
    LOCAL_DONE = "local_done"  # writer -> trainer: shard committed on this node (payload: path)
    OUTCOME = "outcome"  # writer -> trainer: global outcome (error None = committed everywhere)
    ERROR = "error"  # writer -> trainer: the local commit failed (error: message)
    BYE = "bye"  # writer -> trainer: shut down cleanly
    PERSISTED = "persisted"  # writer -> trainer: the step's upload ended (error None = in the manifest)
    DEVICE_BUFFER = "device_buffer"  # trainer -> writer: (id, CUDA IPC args, device, slots to page-lock)
    PIN_SLOTS = "pin_slots"  # trainer -> writer: slot files to page-lock now (payload: as DEVICE_BUFFER's)
    DEVICE_READY = "device_ready"  # writer -> trainer: the buffer is open (payload: id; error: why not)
    DRAINED = "drained"  # writer -> trainer: done reading the device-side snapshot for this step
    PERSIST_AGAIN = "persist_again"  # trainer -> writer: upload a committed step now (payload: (folder, timeline))
    ALIVE = "alive"  # writer -> trainer: its heartbeat, every HEARTBEAT_S from a thread of its own


@dataclass(frozen=True)
class Message:
    kind: Kind
    gen: int
    seq: int = 0
    step: int = -1
    payload: Any = None
    error: str | None = None
    error_type: str | None = None


@dataclass(frozen=True, kw_only=True)
class WriterParams:
    """What a writer needs to start (picklable: crosses the process boundary)."""

    rank: int
    gen: int
    store: StoreAddress | None  # None: a single rank, no job store
    outcome_timeout_s: float
    world_size: int = 1
    targets: tuple[int, ...] = ()  # ranks that keep this rank's replicas
    sources: tuple[int, ...] = ()  # ranks whose replicas this rank keeps
    local_dir: str = ""
    job: str = ""
    node: str = ""
    keep: int = 2
    share_replicas: bool = True  # a partner's identical shard here is kept as a sidecar only
    persist: PersistParams | None = None
    incarnation: int = 0  # 0: the rank's first writer; n: started again after n deaths
    node_folders: tuple[int, ...] | None = None  # the node's lowest rank: the ranks whose folders belong here
    log_level: int = 30  # the trainer's level for the "incluster" logger: a writer process logs at it too
