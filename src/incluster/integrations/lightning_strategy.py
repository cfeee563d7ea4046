"""A Lightning strategy mix-in that saves and restores every rank's state through incluster.

Lightning's ``CheckpointIO`` plugin is called on rank 0 only, and the FSDP and
ModelParallel strategies bypass it, so a rank-local save has to live in the strategy:
``save_checkpoint``/``load_checkpoint`` run on every rank. The mix-in intercepts the
path :data:`INCLUSTER` (``"incluster"``) and leaves every other path to the strategy it
is mixed into, so ``ModelCheckpoint`` files keep working next to in-cluster saves.

Restoring always happens after the strategy's setup (``restore_checkpoint_after_setup``),
so the model is wrapped and the optimizers exist: incluster restores both in place.
No Lightning import here: the concrete classes are made in ``lightning.py``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from incluster import Checkpointer
from incluster.errors import CheckpointError
from incluster.handle import SaveHandle
from incluster.integrations import lightning_state as ls
from incluster.integrations.rng import refuse_resize

log = logging.getLogger(__name__)

INCLUSTER = "incluster"
"""The checkpoint path that means "incluster": ``trainer.fit(model, ckpt_path=INCLUSTER)``
resumes from the newest step recoverable from any tier (or starts fresh when there is none)."""

CheckpointerSpec = Union[Mapping[str, Any], Callable[[], Checkpointer], None]


class InclusterStrategyMixin:
    """Mixed in front of a Lightning strategy (``class S(InclusterStrategyMixin, DDPStrategy)``).

    ``checkpointer``: the ``incluster.Checkpointer`` options as a dict, or a function that
    returns a Checkpointer; it is created on first use, after the process group exists."""

    _incluster_sharded = False  # True: save/restore model and optimizers through torch DCP views

    def __init__(self, *args: Any, checkpointer: CheckpointerSpec = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if checkpointer is not None and not isinstance(checkpointer, Mapping) and not callable(checkpointer):
            raise TypeError(
                "checkpointer= takes a dict of incluster.Checkpointer options or a function that returns "
                f"a Checkpointer, not a {type(checkpointer).__name__}"
            )
        self._incluster_spec = checkpointer
        self._incluster_ckpt: Checkpointer | None = None
        self._incluster_dumping = False
        self.incluster_last_save: SaveHandle | None = None
        """The handle of the newest save (its ``durable`` future says when a restart finds it)."""
        self.incluster_restored_step: int | None = None
        """The step the last ``ckpt_path="incluster"`` restored; None when it found none."""

    # -- the Checkpointer ----------------------------------------------------------------
    @property
    def incluster(self) -> Checkpointer:
        """This rank's Checkpointer, created on first use (after ``init_process_group``)."""
        if self._incluster_ckpt is None:
            spec = self._incluster_spec
            if spec is None or isinstance(spec, Mapping):
                self._incluster_ckpt = Checkpointer(**dict(spec or {}))
                self._incluster_ckpt.persist_last = True  # the fit's last step outlives the nodes: catch_up.py
            else:
                made = spec()
                if not isinstance(made, Checkpointer):
                    raise TypeError(f"checkpointer= returned a {type(made).__name__}; return an incluster.Checkpointer")
                self._incluster_ckpt = made
        return self._incluster_ckpt

    def teardown(self) -> None:
        """Drain and close the Checkpointer (a later fit creates a new one), then the strategy."""
        ckpt, self._incluster_ckpt = self._incluster_ckpt, None
        try:
            if ckpt is not None:
                ckpt.close()
        finally:
            super().teardown()  # type: ignore[misc]

    def on_train_start(self) -> None:
        """A step saved on an epoch's last batch (``every_n_steps`` dividing the epoch, or the
        fit's last step) resumes in the next epoch: Lightning's fit loop closes the saved epoch
        as it resets, but keeps its "restarted mid-epoch" stage for the next one, which it
        then never counts as started. A later save in that epoch looked unstarted, and its
        resume went back to the epoch's first batch: batches trained twice, the fit longer.
        The next epoch now starts as in an uninterrupted run (started, its hooks called)."""
        super().on_train_start()  # type: ignore[misc]
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        loop = getattr(trainer, "fit_loop", None)
        epochs = getattr(loop, "epoch_progress", None)
        if (loop is not None and epochs is not None and getattr(loop, "restarted_mid_epoch", False)
                and loop.epoch_loop.batch_progress.is_last_batch
                and epochs.current.processed == epochs.current.started):  # the reset closed the epoch
            loop.reset_restart_stage()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # restore into the wrapped model and the optimizers, in place

    def process_dataloader(self, dataloader: object) -> object:
        """Give the loader's sampler the fit loop's epoch before Lightning iterates it.

        A resumable loader (one with ``state_dict``/``load_state_dict``) fast-forwards its
        sampler when Lightning first iterates it, which Lightning does before it calls
        ``set_epoch``: a shuffling sampler would skip ahead in epoch 0's order, not the
        restored epoch's. Lightning sets the same value a moment later. A step saved on an
        epoch's last batch resumes in the next epoch (its loader starts afresh there), which
        Lightning counts only after it made the loader's iterator."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        if trainer is not None:
            epochs = trainer.fit_loop.epoch_progress.current
            training = getattr(trainer.state.stage, "value", None) == "train"  # not a validation loader
            finished = (training and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
                        and epochs.processed < epochs.started)
            epoch = epochs.processed + 1 if finished else epochs.processed
            batch_sampler = getattr(dataloader, "batch_sampler", None)
            for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
                set_epoch = getattr(sampler, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
        return dataloader

    # -- the live parts ------------------------------------------------------------------
    def _incluster_parts(self) -> tuple[Any, list[Any]]:
        """The model and optimizers incluster saves and restores in place."""
        module = self.lightning_module  # type: ignore[attr-defined]
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]  # type: ignore[attr-defined]
        if not self._incluster_sharded:
            return module, optimizers
        model = self.model  # type: ignore[attr-defined]
        return _ShardedModel(model), [_ShardedOptimizer(model, o) for o in optimizers]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._incluster_dumping:
            return {}  # incluster saves the live model instead; skip the strategy's gather
        return super().lightning_module_state_dict()  # type: ignore[misc,no-any-return]

    def optimizer_state(self, optimizer: Any) -> Any:
        if self._incluster_dumping:
            return {}
        return super().optimizer_state(optimizer)  # type: ignore[misc]

    # -- save ------------------------------------------------------------------------------
    def incluster_save(self, trainer: Any, step: int | None = None, persist: bool | None = None) -> SaveHandle:
        """Save the trainer's full state as ``step`` (default: ``trainer.global_step``).
        Every rank calls it at the same point; returns in about a millisecond. ``persist``:
        as ``Checkpointer.save``."""
        self._incluster_dumping = True
        try:
            # Not trainer.save_checkpoint(): that ends with a barrier (a host sync on NCCL).
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._incluster_dumping = False
        return self._incluster_save_dict(checkpoint, step, persist)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if str(filepath) != INCLUSTER:
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc,no-any-return]
        self._incluster_save_dict(checkpoint, None)

    def _incluster_save_dict(self, checkpoint: Mapping[str, Any], step: int | None,
                             persist: bool | None = None) -> SaveHandle:
        model, optimizers = self._incluster_parts()
        state = ls.to_state(checkpoint, model, optimizers)
        handle = self.incluster.save(int(checkpoint["global_step"] if step is None else step), state, persist=persist)
        self.incluster_last_save = handle
        return handle

    # -- restore ---------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if str(checkpoint_path) != INCLUSTER:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc,no-any-return]
        model, optimizers = self._incluster_parts()
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        fitting = getattr(trainer.state.fn, "value", None) == "fit"
        state = ls.template(model, optimizers if fitting else [])
        why = "Lightning's loop and data-loader positions and each rank's RNG are per process"
        self.incluster._refuse_resize = why  # refused before anything is restored, in these words
        self.incluster._left_out_ok = not fitting  # validate/test/predict: the optimizers are not wanted
        try:
            step = self.incluster.load(state)
        finally:
            self.incluster._left_out_ok = False  # this load's alone
        refuse_resize(self.incluster, why)
        self.incluster_restored_step = step
        if not any(getattr(cb, "_incluster_saves", False) for cb in getattr(trainer, "callbacks", [])):
            log.warning("incluster: this fit resumes from incluster but has no InclusterCheckpoint callback, so it "
                        "saves nothing there; add callbacks=[InclusterCheckpoint(every_n_steps=N)]")
        # (a job named from the launch: the Checkpointer's own warning said it already)
        if step is None and self.is_global_zero and not getattr(self.incluster, "_job_derived", False):  # type: ignore[attr-defined]
            log.warning("incluster: job %r has no checkpoint yet; training starts from scratch (Lightning's "
                        "\"Restored all states\" restores nothing)", self.incluster.config.job)
        if step is None:
            return _NoCheckpoint(trainer)
        return ls.to_checkpoint(
            state, model.state_dict(), [o.state_dict() for o in optimizers] if fitting else []
        )


class _NoCheckpoint(dict):  # type: ignore[type-arg]
    """What ``load_checkpoint`` returns when nothing was saved yet: Lightning restores
    nothing from a falsy dict (every ``restore_*`` step starts with ``if not checkpoint``),
    and its version migration, which runs first, finds the current version."""

    def __init__(self, trainer: Any) -> None:
        package = importlib.import_module(type(trainer).__module__.split(".")[0])
        super().__init__({"pytorch-lightning_version": package.__version__})

    def __bool__(self) -> bool:
        return False


class _ShardedModel:
    """This rank's shards of a sharded model (FSDP, FSDP2, tensor parallel) as DTensors,
    through torch's distributed state-dict API, without moving them to the CPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_options())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict, options=_options())


class _ShardedOptimizer:
    """One optimizer's sharded state (keyed by parameter name) for :class:`_ShardedModel`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer, options=_options())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=_options())


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def require_strategy(strategy: Any, names: Sequence[str]) -> InclusterStrategyMixin:
    """The strategy, if it saves through incluster; else an error that names the fix."""
    if isinstance(strategy, InclusterStrategyMixin):
        return strategy
    raise CheckpointError(
        f"the Trainer's strategy is a {type(strategy).__name__}, which does not save through incluster; pass "
        f"strategy={names[0]}(checkpointer=dict(...)) (or one of {', '.join(names[1:])}) from "
        f"incluster.integrations.lightning"
    )
