"""Training-state pieces the Hugging Face integrations share: the random number generators
and a training loader's position, as Stateful objects incluster stores without pickle.

``RngState`` is what the Trainer's ``rng_state.pth`` and accelerate's ``random_states_*.pkl``
hold (Python, NumPy, torch CPU and CUDA generators) as tensors and JSON scalars.
``DataPosition`` is where an epoch stands, with the generators that drew its order, so a
resumed run can skip to the same batch and draw the same data (see
``incluster.integrations.accelerate.AcceleratorCheckpoint.batches``). ``trainer_checkpoint``
finds the Trainer's own newest ``checkpoint-N`` folder. Imports no framework.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

import torch

from incluster.errors import CheckpointError
from incluster.integrations.rng import RngState

__all__ = ["RngState", "DataPosition", "loader_generators", "set_generators", "trainer_checkpoint"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class DataPosition:
    """Where the training data stands, Stateful: the epoch and how many of its batches had
    been taken at the save; the global RNG states and the loader's own generators (a
    sampler's, the loader's) at that epoch's start, which drew its order; and the loader's
    generators at the save, from which the next epoch draws."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0
        self.batch_size: int | None = None  # samples per batch, all processes together (None: unknown)
        self.rng_at_start: dict[str, Any] | None = None
        self.generators_at_start: list[torch.Tensor] = []
        self.generators_saved: list[torch.Tensor] = []  # as loaded
        self.live: list[torch.Generator] = []  # the generators of the loader being iterated

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "batch_size": self.batch_size,
            "rng_at_start": self.rng_at_start,
            "generators_at_start": list(self.generators_at_start),
            "generators": [g.get_state() for g in self.live],
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.epoch, self.batches = int(sd["epoch"]), int(sd["batches"])
        self.batch_size = sd.get("batch_size")  # absent in checkpoints of older versions
        self.rng_at_start = sd.get("rng_at_start")
        self.generators_at_start = list(sd.get("generators_at_start") or [])
        self.generators_saved = list(sd.get("generators") or [])


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a (prepared) DataLoader draws from besides the global
    one: accelerate's synchronized generator, the loader's own (worker seeds), its sampler's
    (the shuffle order). In a fixed order, each once."""
    bs = getattr(loader, "batch_sampler", None)
    samplers = [getattr(loader, "sampler", None), bs, getattr(bs, "sampler", None),
                getattr(getattr(bs, "batch_sampler", None), "sampler", None)]
    found: list[torch.Generator] = []
    for g in [getattr(loader, "synchronized_generator", None), getattr(loader, "generator", None),
              *[getattr(s, "generator", None) for s in samplers]]:
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def set_generators(gens: list[torch.Generator], states: list[torch.Tensor]) -> None:
    if not states:
        return  # saved before the loader was iterated: nothing drawn from them yet
    if len(gens) != len(states):
        raise CheckpointError(
            f"the data loader draws from {len(gens)} generator(s) of its own but the saved run's drew "
            f"from {len(states)}; resume with a loader built the same way (sampler, generator=)"
        )
    for g, st in zip(gens, states):
        g.set_state(st.to(torch.uint8).cpu())


_TRAINER_FOLDER = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


def trainer_checkpoint(output_dir: str | None) -> str | None:
    """The newest ``checkpoint-N`` folder a ``transformers.Trainer`` wrote into
    ``output_dir`` (one with its ``trainer_state.json``), or None. Under torch.distributed
    every rank must find the same one: a rank that resumed from another step than its
    peers would train on from a mixed state."""
    found: list[tuple[int, str]] = []
    try:
        names = os.listdir(output_dir) if output_dir else []
    except OSError:
        names = []
    for name in names:
        m = _TRAINER_FOLDER.match(name)
        path = os.path.join(str(output_dir), name)
        if m and os.path.isfile(os.path.join(path, "trainer_state.json")):
            found.append((int(m.group(1)), path))
    newest = max(found)[1] if found else None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, None if newest is None else os.path.basename(newest))
        if len(set(seen)) > 1:
            raise CheckpointError(
                f"the job holds no incluster step, and the ranks find different Trainer checkpoints in "
                f"output_dir {output_dir!r} (rank by rank: {seen}); give every rank the same output_dir "
                f"(a shared folder), or pass resume_from_checkpoint='<output_dir>/checkpoint-N'")
    return newest


def first_trainer_save(args: Any, state: Any, max_steps: int, steps_per_epoch: int) -> int | None:
    """The global step of the Trainer's first save after ``state.global_step``, as its
    ``DefaultFlowCallback`` decides it: every ``state.save_steps`` (a ratio made absolute)
    and at ``max_steps``, or at each epoch's end; with ``save_strategy="best"``, at the
    first evaluation (the first metric is always the best yet). None: no save (strategy
    "no", or nothing left to train)."""
    start = int(state.global_step)
    if max_steps <= start:
        return None

    def value(v: Any) -> str:
        return str(getattr(v, "value", v))

    strategy, every = value(args.save_strategy), int(state.save_steps or 0)
    if strategy == "best":
        strategy, every = value(args.eval_strategy), int(state.eval_steps or 0)
    if strategy == "steps":
        return min((start // every + 1) * every, max_steps) if every > 0 else max_steps
    if strategy == "epoch" and steps_per_epoch > 0:
        return min((start // steps_per_epoch + 1) * steps_per_epoch, max_steps)
    return None


def newest_held(ckpt: Any) -> int:
    """The newest step any rank's node holds of the checkpointer's job (-1: none): every
    rank decides alike, and one on a replaced node, its RAM empty, does not train on alone."""
    held = int(ckpt.ring.newest_step())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, held)
        held = max(int(s) for s in seen)
    return held
