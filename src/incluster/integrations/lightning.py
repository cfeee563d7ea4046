"""PyTorch Lightning: every rank saves its own state into incluster, and
``trainer.fit(model, ckpt_path="incluster")`` resumes from the newest recoverable step.

- ``InclusterDDPStrategy`` / ``InclusterFSDPStrategy`` / ``InclusterModelParallelStrategy``:
  Lightning's strategies with ``save_checkpoint``/``load_checkpoint`` going through an
  ``incluster.Checkpointer`` on every rank for the path ``"incluster"`` (see
  ``lightning_strategy``); other paths behave as before.
- ``InclusterCheckpoint(every_n_steps=N)``: a callback that saves after every Nth optimizer
  step and after the fit's last one (which also goes to the persistent tier, if there is
  one, whatever its schedule), keeps each rank's random number generators in the
  checkpoint, and refuses a mid-epoch resume whose resumable loader has another batch size.

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
import logging
import weakref
from types import SimpleNamespace
from typing import Any

from incluster.errors import CheckpointError
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

log = logging.getLogger("incluster")
_NAMES = ("InclusterDDPStrategy", "InclusterFSDPStrategy", "InclusterModelParallelStrategy")


class _CheckpointHooks:
    """The callback's behaviour; mixed with the package's ``Callback`` in :func:`for_package`."""

    _incluster_saves = True  # what the strategy looks for: something saves to incluster

    def __init__(self, every_n_steps: int, *, rng: bool = True, save_last: bool = True) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1 (got {every_n_steps!r})")
        super().__init__()
        self.every_n_steps = every_n_steps
        self.rng = rng
        self.save_last = save_last
        self._last_saved = -1
        self._pending_rng: dict[str, Any] | None = None
        self._trainer: Any = None  # a weak reference, set in setup()
        self._saved_batch_size: Any = None  # the resumable train loaders' batch sizes, as saved

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        require_strategy(trainer.strategy, _NAMES)
        self._trainer = weakref.ref(trainer)
        say_other_checkpointing(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Right after the optimizer step (global_step just advanced): the same point at which
        # ModelCheckpoint saves, which Lightning's loops know how to resume from. The fit's
        # last step is saved here too, not in on_train_end: by then a fit that stopped at
        # max_steps mid-epoch has marked the epoch done, and a resume would skip its rest.
        step = trainer.global_step
        last = self.save_last and _ends_fit(trainer)
        if step > 0 and (step % self.every_n_steps == 0 or last) and step != self._last_saved:
            self._save(trainer, step, last)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # A fit a callback stopped (EarlyStopping decides after the batch, in validation or at
        # the epoch's end) ends on a step no batch-end saw as its last: saved here. Its epoch
        # is over, as at a max_steps end; a resume goes on as Lightning's own would.
        step = trainer.global_step
        if self.save_last and trainer.should_stop and step > 0 and step != self._last_saved:
            self._save(trainer, step, True)

    def _save(self, trainer: Any, step: int, last: bool) -> None:
        self._last_saved = step
        # The fit's last step outlives the job's nodes only in the persistent tier: it goes there too.
        tier = trainer.strategy.incluster.config.persistent is not None
        trainer.strategy.incluster_save(trainer, step, persist=True if last and tier else None)

    def state_dict(self) -> dict[str, Any]:
        # Lightning's own checkpoint keeps no RNG state (and its file holds rank 0's only);
        # each incluster shard is one rank's, so each rank gets its own generators back.
        state: dict[str, Any] = {"rng": RngState().state_dict()} if self.rng else {}
        trainer = self._trainer() if self._trainer is not None else None
        # the loader in use now: one made again each epoch may have another batch size
        sizes = resumable_batch_sizes(trainer.train_dataloader) if trainer is not None else None
        if sizes is not None:
            state["batch_size"] = sizes
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng") if self.rng else None
        self._saved_batch_size = state_dict.get("batch_size")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # A resumed run's first batches may not step (gradient accumulation): the restored
        # step is saved already and must not be saved again.
        self._last_saved = trainer.global_step
        _refuse_a_fit_behind_its_job(trainer, self.every_n_steps, self.save_last)
        now = resumable_batch_sizes(trainer.train_dataloader)
        saved, self._saved_batch_size = self._saved_batch_size, None
        if saved is not None and now is not None and saved != now:
            progress = trainer.fit_loop.epoch_loop.batch_progress
            if progress.current.ready > 0 and not progress.is_last_batch:  # resumes mid-epoch
                raise CheckpointError(
                    f"the restored step {trainer.global_step} was saved {progress.current.ready} batches into "
                    f"an epoch with train batch size {saved}, but the train loader now has {now}: "
                    f"its restored position would skip samples the run never trained on. Resume with batch "
                    f"size {saved}, and change it at an epoch boundary (a loader made again each epoch: "
                    f"Trainer(reload_dataloaders_every_n_epochs=1))"
                )
        # After the restore and after the train dataloader's iterator exists (creating it
        # draws from the global generator): the next draw is the one the saved run made next.
        if self._pending_rng is not None:
            RngState().load_state_dict(self._pending_rng)
            self._pending_rng = None


def say_other_checkpointing(trainer: Any) -> None:
    """Lightning's own ``ModelCheckpoint`` (on by default: ``enable_checkpointing=True``)
    writes full ``.ckpt`` files beside incluster's saves, with the training loop blocked
    while each is written: said once per trainer, on rank 0, with the fix."""
    others = [cb for cb in getattr(trainer, "checkpoint_callbacks", None) or []
              if not getattr(cb, "_incluster_saves", False)]
    if not others or getattr(trainer, "_incluster_said_other", False) or not getattr(trainer, "is_global_zero", True):
        return
    trainer._incluster_said_other = True
    where = ", ".join(sorted({str(getattr(cb, "dirpath", None) or "the default checkpoints folder") for cb in others}))
    log.warning(
        "incluster: Lightning's %s also saves full checkpoints (%s), blocking training while each is written; "
        "pass Trainer(enable_checkpointing=False) to checkpoint through incluster only (keep it only if you "
        "also want those files)", ", ".join(sorted({type(cb).__name__ for cb in others})), where)


def _refuse_a_fit_behind_its_job(trainer: Any, every: int, save_last: bool) -> None:
    """A fit started without ``ckpt_path="incluster"`` on a job that holds newer steps
    trained until its first save, which incluster refuses (steps must increase): say so
    before training, with the fix. Every rank decides alike (the newest step any node
    holds): one on a replaced node, its RAM empty, must not train on alone."""
    if str(getattr(trainer, "ckpt_path", None)) == INCLUSTER:
        return
    import torch

    ckpt = trainer.strategy.incluster
    held = ckpt.ring.newest_step()
    if trainer.world_size > 1:
        mine = torch.tensor(float(held), device=trainer.strategy.root_device)
        held = int(trainer.strategy.reduce(mine, reduce_op="max").item())
    first = (trainer.global_step // every + 1) * every
    if 0 <= trainer.max_steps < first:  # the fit ends before its first periodic save
        if not save_last:
            return
        first = trainer.max_steps
    if held >= 0 and first <= held:
        raise CheckpointError(
            f"job {ckpt.config.job!r} already holds step {held}, and this fit starts at step "
            f"{trainer.global_step} without ckpt_path=\"incluster\": its first save (step {first}) would be refused, "
            f"as checkpoint steps must increase. Pass trainer.fit(..., ckpt_path=\"incluster\") to continue the "
            f"job, or give the strategy another job (checkpointer=dict(job=...)) to start afresh")


def _ends_fit(trainer: Any) -> bool:
    """Whether the batch that just ended is the fit's last: ``max_steps`` reached, or the
    last batch of the last epoch (an early stop is decided later, in validation)."""
    if 0 <= trainer.max_steps <= trainer.global_step:
        return True
    epochs = trainer.max_epochs
    last_epoch = epochs is not None and epochs >= 0 and trainer.current_epoch + 1 >= epochs
    return last_epoch and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def resumable_batch_sizes(loaders: Any) -> Any:
    """The batch size of each train loader that resumes mid-epoch (has ``load_state_dict``),
    in the shape Lightning holds them (one loader, or a list or dict of them); None when
    none does."""
    if isinstance(loaders, dict):
        sizes = {str(k): resumable_batch_sizes(v) for k, v in loaders.items()}
        return sizes if any(v is not None for v in sizes.values()) else None
    if isinstance(loaders, (list, tuple)):
        listed = [resumable_batch_sizes(v) for v in loaders]
        return listed if any(v is not None for v in listed) else None
    if not callable(getattr(loaders, "load_state_dict", None)):
        return None
    size = getattr(loaders, "batch_size", None)
    if size is None:  # a batch_sampler= loader
        size = getattr(getattr(loaders, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


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
        {"__doc__": "Save through incluster after every ``every_n_steps``-th optimizer step and after the "
                    "fit's last one (``max_steps`` or ``max_epochs``; ``save_last=False``: not there)."},
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
