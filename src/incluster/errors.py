"""The exception hierarchy. Every message says what went wrong and what to do about it.

Background failures (staging, commit) are captured and raised again from ``wait()``,
``wait_staged()`` or the next ``save()``; nothing is swallowed.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error incluster raises on purpose."""


class CorruptCheckpointError(CheckpointError):
    """A stored file failed validation (bad header, bad offsets, checksum mismatch)."""


class CommitError(CheckpointError):
    """A save could not be committed (staging or local commit failed)."""


class TierUnavailableError(CheckpointError):
    """A storage tier could not be reached or has no room."""


class PeerTimeoutError(CheckpointError):
    """A peer or a wait did not answer in time."""


class StoreLostError(PeerTimeoutError):
    """The job store (served by rank 0's process) went away while a step's outcome was
    awaited: the outcome is unknown here, so what this node holds of the step is kept."""


class WriterProcessDied(CheckpointError):
    """The background writer died; the message carries its pid and exit code."""


class NoCheckpointError(CheckpointError):
    """No complete checkpoint exists where one was required."""


__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "CommitError",
    "TierUnavailableError",
    "PeerTimeoutError",
    "WriterProcessDied",
    "NoCheckpointError",
]
