"""incluster: in-cluster, multi-tier, asynchronous checkpointing for PyTorch.

``Checkpointer``, ``Config`` and ``SaveHandle`` are imported on first use, so the command
line tools that need no torch (``incluster goodput``, ``--help``) start in a fraction of
a second.
"""

from typing import TYPE_CHECKING, Any

from incluster.errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    NoCheckpointError,
    PeerTimeoutError,
    TierUnavailableError,
    WriterProcessDied,
)

if TYPE_CHECKING:
    from incluster.checkpointer import Checkpointer
    from incluster.config import Config
    from incluster.handle import SaveHandle

__version__ = "0.1.0"

_LAZY = {"Checkpointer": "incluster.checkpointer", "Config": "incluster.config", "SaveHandle": "incluster.handle"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # ``incluster.config.resolve`` after a bare ``import incluster``
        try:
            return importlib.import_module(f"incluster.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"incluster.{name}":
                raise
    raise AttributeError(f"module 'incluster' has no attribute {name!r}")

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
