"""What the slot ring is made of: a slot, its states, and the names of its files (see
:mod:`incluster.staging.slots`)."""

from __future__ import annotations

import enum
import mmap
import os
import re
from dataclasses import dataclass, field

import torch

STAGING_PREFIX = ".staging-"
_SHARD = re.compile(r"^step-(\d{12,})\.safetensors$")
_SIDECAR = re.compile(r"^step-(\d{12,})\.json$")
_SET_ASIDE = re.compile(r"^step-(\d{12,})\.json\.bad$")  # a record set aside with its bad copy


def step_file(step: int) -> str:
    return f"step-{step:012d}.safetensors"


def sidecar_file(step: int) -> str:
    return f"step-{step:012d}.json"


class SlotState(enum.Enum):
    FREE = "free"  # holds nothing anyone needs
    STAGING = "staging"  # a save is copying into it
    COMMITTING = "committing"  # staged; the writer is checksumming and committing
    COMMITTED = "committed"  # holds a committed step (its sidecar exists)


@dataclass(eq=False)
class Slot:
    index: int
    path: str
    state: SlotState = SlotState.FREE
    step: int | None = None
    size: int = 0
    fd: int = -1
    mm: mmap.mmap | None = None
    buf: torch.Tensor | None = None  # uint8 view of the whole mapping
    header_fp: str | None = None  # layout whose header is written in the file
    views: list[torch.Tensor] = field(default_factory=list)
    maps: int = 0  # how many times this slot was (re)mapped: stays 1 while sizes match
    pinned: bool = False  # mapping registered with CUDA as page-locked memory
    pinned_on: int | None = None  # the GPU whose context registered it
    uploading: bool = False  # the persistent tier is reading it: never reused meanwhile
    warming: bool = False  # being mapped ahead on the staging thread (next_taken): not retired meanwhile

    def unmap(self) -> None:
        self.views = []
        self.buf = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping closes when it goes
            self.mm = None
        self.header_fp = None


def allocated(path: str) -> int:
    """Bytes of RAM a slot file holds (0 when there is none)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:  # gone (or unreadable): holds nothing this ring can count
        return 0
