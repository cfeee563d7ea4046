"""PyTorch Lightning: every rank saves its own state into incluster, and
``trainer.fit(model, ckpt_path="incluster")`` resumes from the newest recoverable step.

- ``InclusterDDPStrategy`` / ``InclusterFSDPStrategy`` / ``InclusterModelParallelStrategy``:
  Lightning's strategies with ``save_checkpoint``/``load_checkpoint`` going through an
  ``incluster.Checkpointer`` on every rank for the path ``"incluster"`` (see
  ``lightning_strategy``); other paths behave as before.
- ``InclusterCheckpoint(every_n_steps=N)``: a callback that saves after every Nth optimizer
  step and keeps each rank's random number generators in the checkpoint.

Lightning's loops (epoch, global step, batch progress, a stateful dataloader's position),
callback states, LR schedulers, precision-plugin state and hyper-parameters are stored
with the model and optimizer states, and restored by Lightning's own restore sequence.

The classes subclass ``pytorch_lightning`` (or ``lightning.pytorch`` when only that is
installed); :func:`for_package` makes them for a given one. Importing this module does
not import Lightning; reading one of the class names does.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

from incluster.integrations.rng import RngState
from incluster.integrations.lightning_strategy import INCLUSTER, InclusterStrategyMixin, require_strategy

__all__ = [
    "INCLUSTER",
    "InclusterStrategyMixin",
    "InclusterDDPStrategy",
    "InclusterFSDPStrategy",
    "InclusterModelParallelStrategy",
    "InclusterCheckpoint",
    "for_package",
]

_NAMES = ("InclusterDDPStrategy", "InclusterFSDPStrategy", "InclusterModelParallelStrategy")


class _CheckpointHooks:
    """The callback's behaviour; mixed with the package's ``Callback`` in :func:`for_package`."""

    _incluster_saves = True  # what the strategy looks for: something saves to incluster

    def __init__(self, every_n_steps: int, *, rng: bool = True) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1 (got {every_n_steps!r})")
        super().__init__()
        self.every_n_steps = every_n_steps
        self.rng = rng
        self._last_saved = -1
        self._pending_rng: dict[str, Any] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        require_strategy(trainer.strategy, _NAMES)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Right after the optimizer step (global_step just advanced): the same point at which
        # ModelCheckpoint saves, which Lightning's loops know how to resume from.
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_saved:
            self._last_saved = step
            trainer.strategy.incluster_save(trainer, step)

    def state_dict(self) -> dict[str, Any]:
        # Lightning's own checkpoint keeps no RNG state (and its file holds rank 0's only);
        # each incluster shard is one rank's, so each rank gets its own generators back.
        return {"rng": RngState().state_dict()} if self.rng else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng") if self.rng else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # A resumed run's first batches may not step (gradient accumulation): the restored
        # step is saved already and must not be saved again.
        self._last_saved = trainer.global_step
        # After the restore and after the train dataloader's iterator exists (creating it
        # draws from the global generator): the next draw is the one the saved run made next.
        if self._pending_rng is not None:
            RngState().load_state_dict(self._pending_rng)
            self._pending_rng = None


@functools.lru_cache(maxsize=None)
def for_package(package: str = "pytorch_lightning") -> SimpleNamespace:
    """The incluster strategies and callback for ``package`` (``"pytorch_lightning"`` or
    ``"lightning.pytorch"``): use the ones that match the ``Trainer`` you import."""
    pl = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")

    def strategy(name: str, base: type, sharded: bool) -> type:
        doc = f"Lightning's ``{base.__name__}``; ``checkpointer=`` as in ``InclusterStrategyMixin``."
        return type(name, (InclusterStrategyMixin, base), {"__doc__": doc, "_incluster_sharded": sharded})

    callback = type(
        "InclusterCheckpoint",
        (_CheckpointHooks, pl.Callback),
        {"__doc__": "Save through incluster after every ``every_n_steps``-th optimizer step."},
    )
    return SimpleNamespace(
        InclusterDDPStrategy=strategy("InclusterDDPStrategy", strategies.DDPStrategy, False),
        InclusterFSDPStrategy=strategy("InclusterFSDPStrategy", strategies.FSDPStrategy, True),
        InclusterModelParallelStrategy=strategy(
            "InclusterModelParallelStrategy", strategies.ModelParallelStrategy, True
        ),
        InclusterCheckpoint=callback,
    )


def _default_package() -> str:
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    raise ImportError("incluster.integrations.lightning needs Lightning: pip install pytorch-lightning")


def __getattr__(name: str) -> Any:
    if name in (*_NAMES, "InclusterCheckpoint"):
        return getattr(for_package(_default_package()), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
