"""Hugging Face Accelerate: what ``accelerator.save_state()`` writes, as one incluster state.

``AcceleratorCheckpoint(accelerator, ckpt)`` gathers everything accelerate's own
``save_state`` would write - the prepared models, optimizers and LR schedulers, the
gradient scaler, the objects passed to ``accelerator.register_for_checkpointing``, the
random number generators and ``accelerator.step`` - plus the training dataloader's
position, and saves and restores them through an :class:`incluster.Checkpointer`
(rank-local and asynchronous: ``save`` returns in about a millisecond)::

    ac = AcceleratorCheckpoint(accelerator, incluster.Checkpointer(job="run-7"))
    start = ac.load()                                   # newest complete step, or None
    step = 0 if start is None else start
    for epoch in range(ac.epoch, num_epochs):
        for batch in ac.batches(train_loader, epoch):   # skips what that step had consumed
            ...; optimizer.step(); scheduler.step(); optimizer.zero_grad(); step += 1
            if step % 10 == 0:
                ac.save(step)
    ac.close()

:func:`state_for` is the state dict alone, for loops that call ``ckpt.save``/``ckpt.load``
themselves. Importing this module does not import accelerate.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Mapping

from incluster.errors import CheckpointError
from incluster.integrations.hf_state import DataPosition, RngState, loader_generators, set_generators
from incluster.integrations.rng import refuse_resize

__all__ = ["AcceleratorCheckpoint", "state_for", "RngState", "DataPosition"]

log = logging.getLogger("incluster")

# Setups whose model/optimizer states accelerate saves through their own engines.
_UNSUPPORTED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


class _StepCounter:
    """``accelerator.step`` (its gradient-accumulation counter), which ``load_state`` restores."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.accelerator.step = int(sd["step"])


def check_supported(accelerator: Any) -> None:
    """Refuse setups whose states accelerate itself saves through another engine."""
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", "NO")
    if kind in _UNSUPPORTED:
        raise CheckpointError(
            f"incluster's accelerate integration covers single-process and DDP jobs; this accelerator "
            f"runs {kind}, whose model and optimizer states its own engine saves: use "
            f"accelerator.save_state()/load_state() for it"
        )


def _warn_unsynchronized(accelerator: Any, checkpointer: Any) -> None:
    """A launch of several processes that accelerate runs as one each (``Accelerator()``
    under torchrun on a machine without GPUs: no DDP unless ``cpu=True``) trains copies
    that never synchronize, while incluster saves them as the ranks of one job."""
    procs, world = int(getattr(accelerator, "num_processes", 1)), int(getattr(checkpointer, "world_size", 1))
    if procs != world:
        log.warning("incluster: the launch has %d processes, but accelerate runs %d (distributed type %s): each "
                    "process trains on its own, unsynchronized, and incluster saves them as %d ranks of one job. "
                    "On a machine without GPUs pass Accelerator(cpu=True) for DDP over gloo", world, procs,
                    getattr(getattr(accelerator, "distributed_type", None), "name", "?"), world)


def state_for(accelerator: Any, **extra: Any) -> dict[str, Any]:
    """The incluster state of everything ``accelerator.save_state()`` writes: the prepared
    models, the optimizers and schedulers inside accelerate's wrappers, the gradient scaler,
    the objects registered with ``register_for_checkpointing``, ``accelerator.step`` and the
    RNG states. ``extra`` adds entries (a :class:`DataPosition`, counters, ...).

    Pass the same dict (or one built the same way) to ``ckpt.save(step, state)`` and
    ``ckpt.load(state)``; loading sets the generators at once."""
    check_supported(accelerator)
    # accelerate's registries of what prepare() returned: the lists save_state() walks.
    state: dict[str, Any] = {
        "models": list(accelerator._models),
        "optimizers": [getattr(o, "optimizer", o) for o in accelerator._optimizers],
        "schedulers": [getattr(s, "scheduler", s) for s in accelerator._schedulers],
        "registered": list(accelerator._custom_objects),
        "scaler": accelerator.scaler,
        "accelerator": _StepCounter(accelerator),
        "rng": RngState(),
    }
    clash = sorted(set(extra) & set(state))
    if clash:
        raise CheckpointError(f"extra entries {clash} clash with state_for's own keys; rename them")
    state.update(extra)
    return state


class AcceleratorCheckpoint:
    """Saves and restores an Accelerator's training state through incluster, with the
    training dataloader's position. See the module docstring for the loop.

    ``checkpointer``: an :class:`incluster.Checkpointer`; one with the defaults is made
    when omitted (create it after the process group exists in a multi-process job - the
    Accelerator does that). ``extra``: more entries for the state (tensors, Stateful
    objects, JSON values)."""

    def __init__(self, accelerator: Any, checkpointer: Any = None, *, extra: Mapping[str, Any] | None = None) -> None:
        check_supported(accelerator)
        if checkpointer is None:
            import incluster

            checkpointer = incluster.Checkpointer()
        self.accelerator = accelerator
        self.checkpointer = checkpointer
        _warn_unsynchronized(accelerator, checkpointer)
        self.extra = dict(extra or {})
        self.position = DataPosition()
        self._rng = RngState()
        self._skip: tuple[int, int] | None = None  # (epoch, batches) the resumed epoch skips, once
        self._iterated = False  # batches() was used: the data position is real
        self._warned: set[str] = set()

    @property
    def epoch(self) -> int:
        """The epoch to start the loop at: the saved one after :meth:`load`, else 0."""
        return self.position.epoch

    def state(self) -> dict[str, Any]:
        """The state this object saves and loads (see :func:`state_for`)."""
        st = state_for(self.accelerator, data=self.position, **self.extra)
        st["rng"] = self._rng
        return st

    def save(self, step: int, *, persist: bool | None = None) -> Any:
        """Start saving everything as ``step``; returns the ``SaveHandle`` at once.
        ``persist``: as ``Checkpointer.save`` (True for the run's last step puts it in the
        persistent tier whatever the schedule)."""
        if not getattr(self.accelerator, "sync_gradients", True):
            self._warn("accumulating", (
                f"step {step} is saved in the middle of gradient accumulation (accelerator.sync_gradients is "
                f"False): the gradients accumulated so far are not part of a checkpoint, so a run resumed from "
                f"it differs from the uninterrupted one; save right after an optimizer step "
                f"(when accelerator.sync_gradients is True)"))
        self._refuse_unloaded()
        if not self._iterated:
            self._warn("position", (
                f"step {step} is saved without a data position: the loop does not iterate "
                f"AcceleratorCheckpoint.batches(loader, epoch), so a resumed run starts its epochs over; "
                f"iterate batches() (see the module's loop)"))
        return self.checkpointer.save(step, self.state(), persist=persist)

    def _refuse_unloaded(self) -> None:
        """A run over a job that already holds steps here, without load(): refused before
        the loop trains (the Checkpointer would refuse only the first save, naming its own
        load(), after a save interval of training)."""
        ck = self.checkpointer
        held = getattr(ck, "_held_at_start", -1)
        if getattr(ck, "_loaded", True) or held < 0:
            return
        raise CheckpointError(
            f"job {ck.config.job!r} already holds step {held} on this node from an earlier run, and this run did "
            f"not call AcceleratorCheckpoint.load(): call `start = ac.load()` before the loop to resume the job "
            f"(it returns the step to go on from, or None), or name a new job (job=...) to start afresh")

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("incluster: %s (said once)", text)

    def load(self) -> int | None:
        """Restore the newest step every rank can recover (never an incomplete one), in
        place; returns it, or None when the job has none. Collective."""
        why = "accelerate's data position and RNG states are per process"
        self.checkpointer._refuse_resize = why  # refused before anything is restored, in these words
        step = self.checkpointer.load(self.state())
        refuse_resize(self.checkpointer, why)
        if step is not None:
            self._skip = (self.position.epoch, self.position.batches)
            log.info("incluster: resuming at step %d, epoch %d after %d batches",
                     step, self.position.epoch, self.position.batches)
        return step

    def batches(self, dataloader: Iterable[Any], epoch: int) -> Iterator[Any]:
        """Iterate ``dataloader`` for ``epoch``, counting batches into the saved position.

        In the epoch a restored step was taken in, the global RNG and the loader's own
        generators are first set to their values at that epoch's start (so the loader draws
        the same order and seeds), the batches the step had taken are skipped
        (``accelerator.skip_first_batches``), and once the first remaining batch is drawn
        the global RNG is set to its value at the save: the rest of the epoch sees the data
        and random numbers the interrupted run would have seen. A step saved after the
        epoch's last batch sets the loader's generators to their values at the save and
        yields nothing."""
        if getattr(dataloader, "use_stateful_dataloader", False):
            raise CheckpointError(
                "batches() resumes by skipping batches, which accelerate does not allow for a "
                "StatefulDataLoader; prepare the dataloader without use_stateful_dataloader"
            )
        self._refuse_unloaded()
        self._iterated = True
        pos = self.position
        resumed = self._skip is not None and self._skip[0] == epoch
        skip = self._skip[1] if resumed and self._skip is not None else 0
        size = getattr(dataloader, "total_batch_size", None) or getattr(dataloader, "batch_size", None)
        size = size if isinstance(size, int) else None
        if skip and pos.batch_size is not None and size is not None and size != pos.batch_size:
            raise CheckpointError(
                f"the restored step was saved after {skip} batches of {pos.batch_size} samples in epoch {epoch}, but "
                f"this loader's batches hold {size}: skipping {skip} of them would skip {skip * size} samples, not "
                f"the {skip * pos.batch_size} the run had taken. Resume with batches of {pos.batch_size} (all "
                f"processes together) and change the batch size from the next epoch on")
        pos.batch_size = size
        self._skip = None
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)  # the sampler's order for this epoch, also after a restart
        pos.live = loader_generators(dataloader)
        pos.epoch, pos.batches = epoch, skip
        finished = hasattr(dataloader, "__len__") and skip >= len(dataloader)  # type: ignore[arg-type]
        if resumed and (skip == 0 or finished):
            set_generators(pos.live, pos.generators_saved)
            if finished:
                return  # iterating the finished epoch would draw from the generators
        if skip:
            if pos.rng_at_start is not None:
                RngState().load_state_dict(pos.rng_at_start)
            set_generators(pos.live, pos.generators_at_start)
            source = self.accelerator.skip_first_batches(dataloader, skip)
        else:
            pos.rng_at_start = RngState().state_dict()
            pos.generators_at_start = [g.get_state() for g in pos.live]
            source = dataloader
        resync = skip > 0
        for batch in source:
            if resync:  # back to the values the saved run had after drawing this batch
                self._rng.apply_again()
                resync = False
            pos.batches += 1
            yield batch

    def wait(self) -> None:
        """Wait until every save started so far is durable (raises its error, if any)."""
        self.checkpointer.wait()

    def close(self) -> None:
        """Drain the saves in flight and close the checkpointer."""
        self.checkpointer.close()
