"""incluster: in-cluster, multi-tier, asynchronous checkpointing for PyTorch."""

from incluster.checkpointer import Checkpointer
from incluster.config import Config
from incluster.errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    NoCheckpointError,
    PeerTimeoutError,
    TierUnavailableError,
    WriterProcessDied,
)

from incluster.handle import SaveHandle

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "Config",
    "SaveHandle",
    "CheckpointError",
    "CommitError",
    "CorruptCheckpointError",
    "NoCheckpointError",
    "PeerTimeoutError",
    "TierUnavailableError",
    "WriterProcessDied",
    "__version__",
]
