"""Goodput: what checkpointing costs a job, measured (events, report) and predicted (model).

- ``events``: ``EventRecorder`` writes a process's checkpoint events as JSON lines;
  ``NullRecorder`` stands in when no run folder is given.
- ``report``: a run folder's events, across restarts, become a ``GoodputReport``.
- ``model`` (pure): expected badput of a configuration; Young, Daly and the exact model.
- ``simulate``: a seeded Monte Carlo check of the model (numpy).
- ``scenarios``: the goodput figure's five configurations built from measured ``Costs``.
- ``plot``: the goodput figure and a run's timeline (matplotlib, optional).
- ``cli``: ``incluster goodput report|plan|plot|timeline``.

This package sits beside the checkpointer: it never imports it, and nothing here imports
torch.
"""

from __future__ import annotations

from incluster.goodput.events import NULL_RECORDER, EventRecorder, NullRecorder
from incluster.goodput.model import ModelConfig, ModelResult, TierConfig, evaluate, optimize
from incluster.goodput.report import GoodputReport, build_report

__all__ = [
    "NULL_RECORDER",
    "EventRecorder",
    "GoodputReport",
    "ModelConfig",
    "ModelResult",
    "NullRecorder",
    "TierConfig",
    "build_report",
    "evaluate",
    "optimize",
]
