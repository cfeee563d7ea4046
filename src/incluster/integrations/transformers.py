"""Hugging Face transformers: the ``Trainer`` checkpoints into incluster and resumes from it.

``InclusterTrainer`` (or ``with_incluster(SomeTrainerSubclass)``) replaces the Trainer's
checkpoint folders. Every ``save_steps`` its ``_save_checkpoint`` puts the model, the
optimizer, the LR scheduler, the gradient scaler, the random number generators, the
``TrainerState`` (global step, epoch, log history, callback states) and the data position
into one incluster state, saved asynchronously by every rank into its node's RAM
(``save`` returns in about a millisecond; the copy overlaps the next steps).

``trainer.train(resume_from_checkpoint=True)`` restores the newest step every rank can
recover - from any tier, never an incomplete one - or starts from scratch when the job
has none, so the same command serves the first launch and every restart. The Trainer's
resume logic runs inside ``train()`` before any callback, so the restore hooks into its
own sequence instead: ``_load_from_checkpoint`` (called first, after ``model_init``) loads
the whole state at once - the model in place, the rest held - and writes the
``TrainerState`` as the Trainer's ``trainer_state.json`` into a private folder that stands
in for a checkpoint path; the Trainer then computes the epoch and the batches to skip from
it as usual, and ``_load_optimizer_and_scheduler``, ``_load_scaler`` and ``_load_rng_state``
hand over the held parts at the moments the Trainer calls them. The data position the save
counted is checked against the Trainer's skip before training goes on.

A job that holds no incluster step yet resumes from the newest ``checkpoint-N`` folder
the Trainer itself wrote into ``output_dir`` (a run moved onto incluster keeps its
progress), with a warning that names it; every rank must find the same one. A string path
still resumes from a Trainer checkpoint folder, as before. Importing this
module does not import transformers; reading ``InclusterTrainer`` does.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from incluster.errors import CheckpointError
from incluster.integrations.hf_state import RngState, first_trainer_save, newest_held, trainer_checkpoint

__all__ = ["InclusterTrainer", "InclusterTrainerMixin", "with_incluster"]

log = logging.getLogger("incluster")

_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


_FOLDER_PREFIX = "incluster-trainer-resume-"


def _remove_orphaned_folders() -> None:
    """The resume folders of processes that are gone (a SIGKILL skips train()'s clean-up;
    the Trainer may read the folder again while it runs: auto_find_batch_size)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = name[len(_FOLDER_PREFIX):].split("-", 1)[0]
        if not name.startswith(_FOLDER_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:  # alive, another user's
            pass


class _Held:
    """Stands in, at restore time, for an object the Trainer creates later (the optimizer
    and scheduler exist only after ``accelerator.prepare``): takes the saved state_dict and
    keeps it until the Trainer asks for it."""

    def __init__(self) -> None:
        self.value: Any = None

    def state_dict(self) -> Any:
        return {} if self.value is None else self.value

    def load_state_dict(self, sd: Any) -> None:
        self.value = sd


@dataclasses.dataclass
class _Restored:
    step: int
    parts: dict[str, _Held]
    position: dict[str, Any]


class InclusterTrainerMixin:
    """Mix in before a ``transformers.Trainer`` (sub)class: checkpoints go to incluster.

    ``checkpointer``: an :class:`incluster.Checkpointer`, or a dict of its options (as
    Lightning's strategies take); when omitted or a dict, one (with the defaults:
    ``INCLUSTER_LOCAL_DIR``, job from the launch) is made at the first save or restore
    and closed when ``train()`` returns. ``train()`` returns once its last save is durable.
    """

    def __init__(self, *args: Any, checkpointer: Any = None, **kwargs: Any) -> None:
        self._ic_options: dict[str, Any] = {}
        if isinstance(checkpointer, dict):
            self._ic_options, checkpointer = dict(checkpointer), None
        elif checkpointer is not None and not (hasattr(checkpointer, "save") and hasattr(checkpointer, "load")):
            raise TypeError(f"checkpointer= takes an incluster.Checkpointer or a dict of its options, not a "
                            f"{type(checkpointer).__name__}")
        super().__init__(*args, **kwargs)
        self._ic_checkpointer = checkpointer
        self._ic_owned = False
        self._ic_folder: str | None = None  # the stand-in checkpoint path of a restore
        self._ic_restored: _Restored | None = None
        self._ic_from_trainer: str | None = None  # no incluster step: the Trainer's own checkpoint-N instead
        self._ic_position: dict[str, Any] | None = None
        self.incluster_handle: Any = None  # the SaveHandle of the latest save
        self.incluster_resumed_step: int | None = None

    @property
    def checkpointer(self) -> Any:
        if self._ic_checkpointer is None:
            import incluster

            self._ic_checkpointer, self._ic_owned = incluster.Checkpointer(**self._ic_options), True
            self._ic_checkpointer.persist_last = True  # the run's last step outlives the nodes: catch_up.py
        return self._ic_checkpointer

    # -- train --------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._ic_refuse_unsupported()
        if resume_from_checkpoint is True:
            _remove_orphaned_folders()
            self._ic_folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
            resume_from_checkpoint = self._ic_folder
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
            if self._ic_checkpointer is not None:
                self._ic_checkpointer.wait()
            return out
        finally:
            if self._ic_folder is not None:
                shutil.rmtree(self._ic_folder, ignore_errors=True)
            self._ic_folder, self._ic_restored, self._ic_position = None, None, None
            self._ic_from_trainer = None
            if self._ic_owned and self._ic_checkpointer is not None:
                self._ic_checkpointer.close()
                self._ic_checkpointer, self._ic_owned = None, False

    def _ic_refuse_unsupported(self) -> None:
        t: Any = self
        if t.is_deepspeed_enabled or t.is_fsdp_enabled:
            raise CheckpointError(
                "InclusterTrainer covers single-process and DDP training; DeepSpeed and FSDP save "
                "through their own engines: use transformers.Trainer's checkpoints for them"
            )
        if t.args.load_best_model_at_end:
            raise CheckpointError(
                "load_best_model_at_end reloads a checkpoint folder, which InclusterTrainer does not "
                "write; set load_best_model_at_end=False (call trainer.save_model() for the final model)"
            )

    def _ic_ours(self, checkpoint: Any) -> bool:
        return checkpoint is not None and self._ic_folder is not None and checkpoint == self._ic_folder

    def _ic_path(self, checkpoint: Any) -> Any:
        """The stand-in folder of a job resuming from the Trainer's own checkpoint is that checkpoint."""
        return self._ic_from_trainer if self._ic_from_trainer is not None and self._ic_ours(checkpoint) else checkpoint

    # -- save ---------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t: Any = self
        if trial is not None or t.hp_search_backend is not None:
            raise CheckpointError("InclusterTrainer does not checkpoint hyperparameter-search trials; "
                                  "use transformers.Trainer for hyperparameter_search()")
        t.store_flos()
        self._ic_record_callbacks()
        # The run's last step outlives the job's nodes only in the persistent tier: it goes there too.
        last = 0 < t.state.max_steps <= t.state.global_step and self.checkpointer.config.persistent is not None
        self.incluster_handle = self.checkpointer.save(t.state.global_step, self._ic_state(),
                                                       persist=True if last else None)

    def _ic_record_callbacks(self) -> None:
        """What ``Trainer._save_checkpoint`` does before writing ``trainer_state.json``."""
        from transformers.trainer_callback import ExportableState

        t: Any = self
        for cb in [c for c in t.callback_handler.callbacks + [t.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(t.state.stateful_callbacks[name], list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()

    def _ic_state(self) -> dict[str, Any]:
        t: Any = self
        return {
            "model": t.model,
            "optimizer": getattr(t.optimizer, "optimizer", t.optimizer),  # inside accelerate's wrapper
            "scheduler": t.lr_scheduler,
            "scaler": getattr(t.accelerator, "scaler", None),
            "rng": RngState(),
            "trainer": {
                "state": json.dumps(dataclasses.asdict(t.state), indent=2, sort_keys=True) + "\n",
                "position": dict(self._ic_position or {}),
            },
        }

    # -- data position ------------------------------------------------------------------
    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        a = inspect.signature(super()._run_epoch).bind(*args, **kwargs).arguments  # type: ignore[misc]
        t: Any = self
        if self._ic_restored is not None and t.state.global_step >= t.state.max_steps > 0:
            # The restored step ends the run: the Trainer checks max_steps only after a step,
            # so every rerun of a finished job would train (and save) one step more.
            log.info("incluster: step %d restored; max_steps is %d: nothing left to train",
                     t.state.global_step, t.state.max_steps)
            t.control.should_training_stop = True
            return None
        skipped = 0
        if a["epoch"] == a["epochs_trained"] and a["resume_from_checkpoint"] is not None and not t.args.ignore_data_skip:
            skipped = a["steps_trained_in_current_epoch"]
        self._ic_position = {"epoch": a["epoch"], "batches": skipped, "steps_in_epoch": a["steps_in_epoch"],
                             "batch_size": t._train_batch_size}
        return super()._run_epoch(*args, **kwargs)  # type: ignore[misc]

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if self._ic_position is not None:
            self._ic_position["batches"] += len(batches)
        return batches, items

    # -- restore ------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        if self._ic_from_trainer is not None:  # called again (FSDP, SageMaker): the Trainer's checkpoint
            resume_from_checkpoint = self._ic_path(resume_from_checkpoint)
        if not self._ic_ours(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        from transformers.trainer_callback import TrainerState

        t: Any = self
        parts = {key: _Held() for key in ("optimizer", "scheduler", "scaler", "rng")}
        info: dict[str, Any] = {}
        if not t.args.ignore_data_skip:  # refused before anything is restored (recovery/reshard.py)
            self.checkpointer._refuse_resize = (
                "the Trainer's data position and each process's RNG are per process (pass ignore_data_skip=True "
                "to train on from another position)")
        step = self.checkpointer.load({"model": t.model if model is None else model, **parts, "trainer": info})
        path = os.path.join(resume_from_checkpoint, _STATE_FILE)
        self.incluster_resumed_step = step
        if step is None:
            job = getattr(getattr(self.checkpointer, "config", None), "job", "?")
            own = trainer_checkpoint(t.args.output_dir)
            if own is not None:
                log.warning("incluster: job %r holds no step yet; resuming from the Trainer's own checkpoint %s "
                            "(incluster saves from here on)", job, own)
                super()._load_from_checkpoint(own, model)  # type: ignore[misc]
                shutil.copyfile(os.path.join(own, _STATE_FILE), path)
                self._ic_from_trainer = own
                return
            log.info("incluster: job %r holds no step yet; the Trainer starts from scratch", job)
            TrainerState().save_to_json(path)  # Trainer.train reads it; the restore is then dropped
            return
        saved = json.loads(info["state"])
        if saved.get("global_step") != step:
            raise CheckpointError(
                f"incluster step {step} holds a TrainerState at global step {saved.get('global_step')}; "
                f"it was not saved by InclusterTrainer. Use another job name for this run"
            )
        with open(path, "w", encoding="utf-8") as f:
            f.write(info["state"])
        self._ic_restored = _Restored(step, parts, dict(info.get("position") or {}))

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: Any, trial: Any) -> tuple[int, int]:
        if self._ic_ours(resume_from_checkpoint) and self._ic_restored is None:
            # nothing saved yet: the Trainer's own checkpoint, or a fresh start
            resume_from_checkpoint = self._ic_from_trainer
        epochs, skip = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if self._ic_ours(resume_from_checkpoint) and self._ic_restored is not None:
            self._ic_check_position(epochs, skip)
        else:
            self._ic_refuse_a_run_behind_its_job(max_steps, num_update_steps_per_epoch)
        return epochs, skip

    def _ic_refuse_a_run_behind_its_job(self, max_steps: int, steps_per_epoch: int) -> None:
        """A run that did not restore an incluster step, on a job that holds one as new as
        its first save, would train until that save and then be refused (steps must
        increase): refuse it now, before it trains, naming the fix."""
        t: Any = self
        first = first_trainer_save(t.args, t.state, max_steps, steps_per_epoch)
        held = newest_held(self.checkpointer)  # collective: every rank calls it
        if first is None or first > held:
            return
        job = self.checkpointer.config.job
        if self._ic_folder is not None:  # resume_from_checkpoint=True restored nothing
            raise CheckpointError(
                f"job {job!r} holds step {held} on some node, but no step every rank can restore, so train() "
                f"would start at step {t.state.global_step} and its first save (step {first}) would be refused, as "
                f"checkpoint steps must increase. `incluster ls` shows what each node holds; name a new job "
                f"(checkpointer=dict(job=...)) to start afresh")
        raise CheckpointError(
            f"job {job!r} already holds step {held}, and train() starts at step {t.state.global_step} without "
            f"restoring it: its first save (step {first}) would be refused, as checkpoint steps must increase. "
            f"Pass train(resume_from_checkpoint=True) to continue the job, or name a new job "
            f"(checkpointer=dict(job=...)) to start afresh")

    def _ic_check_position(self, epochs: int, skip: int) -> None:
        """The Trainer derives the batches to skip from the global step; the save counted
        the batches it had taken. They differ when the batch size, gradient accumulation,
        number of processes or dataset changed: training would then silently see other
        data. Compared in samples, so a resume with another batch size that lands on the
        same sample is accepted."""
        t: Any = self
        restored = self._ic_restored
        pos = restored.position if restored is not None else {}
        if not pos or t.args.ignore_data_skip:
            return
        epoch, batches = int(pos["epoch"]), int(pos["batches"])
        if batches >= int(pos["steps_in_epoch"]):
            epoch, batches = epoch + 1, 0
        saved, now = batches * int(pos["batch_size"]), skip * int(t._train_batch_size)
        if (epoch, saved) != (epochs, now):
            raise CheckpointError(
                f"step {restored.step if restored else '?'} was saved after {saved} samples of epoch {epoch}, "
                f"but the Trainer would resume after {now} samples of epoch {epochs}: the batch size, "
                f"gradient accumulation, number of processes or dataset differ from the saved run; "
                f"restore them, or pass ignore_data_skip=True to train on from another position"
            )

    def _ic_part(self, key: str) -> Any:
        return self._ic_restored.parts[key].value if self._ic_restored is not None else None

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        checkpoint = self._ic_path(checkpoint)
        if not self._ic_ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        t: Any = self
        opt, sched = self._ic_part("optimizer"), self._ic_part("scheduler")
        if opt is not None:
            t.optimizer.load_state_dict(opt)
        if sched is not None:
            t.lr_scheduler.load_state_dict(sched)

    def _load_scaler(self, checkpoint: Any) -> None:
        checkpoint = self._ic_path(checkpoint)
        if not self._ic_ours(checkpoint):
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        t: Any = self
        scaler = self._ic_part("scaler")
        if scaler:
            t.accelerator.scaler.load_state_dict(scaler)

    def _load_rng_state(self, checkpoint: Any) -> None:
        checkpoint = self._ic_path(checkpoint)
        if not self._ic_ours(checkpoint):
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        rng = self._ic_part("rng")
        if rng:
            RngState().load_state_dict(rng)


def with_incluster(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass, e.g. trl's ``SFTTrainer``)
    with :class:`InclusterTrainerMixin` in front: checkpoints go to incluster."""
    return type(f"Incluster{trainer_cls.__name__}", (InclusterTrainerMixin, trainer_cls), {"__module__": __name__})


_made: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "InclusterTrainer":
        if name not in _made:
            from transformers import Trainer

            cls = with_incluster(Trainer)
            cls.__name__ = cls.__qualname__ = "InclusterTrainer"
            _made[name] = cls
        return _made[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
