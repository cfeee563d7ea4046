"""Training-state pieces the Hugging Face integrations share: the random number generators
and a training loader's position, as Stateful objects incluster stores without pickle.

``RngState`` is what the Trainer's ``rng_state.pth`` and accelerate's ``random_states_*.pkl``
hold (Python, NumPy, torch CPU and CUDA generators) as tensors and JSON scalars.
``DataPosition`` is where an epoch stands, with the generators that drew its order, so a
resumed run can skip to the same batch and draw the same data (see
``incluster.integrations.accelerate.AcceleratorCheckpoint.batches``). Imports no framework.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import torch

from incluster.errors import CheckpointError

__all__ = ["RngState", "DataPosition", "loader_generators", "set_generators"]


class RngState:
    """The process's random number generators - Python's, NumPy's, torch's CPU generator
    and every CUDA device's - as a Stateful object: ``state_dict()`` reads them (tensors
    and JSON scalars, so incluster stores them without pickle), ``load_state_dict()`` sets
    them and keeps the loaded values in ``loaded`` so they can be set again later."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        version, words, gauss = random.getstate()
        sd: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        np = _numpy()
        if np is not None:  # optional for torch; nothing to keep without it
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            sd["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if torch.cuda.is_available():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loaded = dict(sd)
        py = sd["python"]
        random.setstate((int(py["version"]), tuple(int(w) for w in py["state"].tolist()), py["gauss"]))
        torch.set_rng_state(sd["torch"].to(torch.uint8).cpu())
        if "numpy" in sd:
            import numpy as np

            n = sd["numpy"]
            keys = np.asarray(n["keys"].tolist(), dtype=np.uint32)
            np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))
        if "cuda" in sd and torch.cuda.is_available():
            states = list(sd["cuda"])
            if len(states) != torch.cuda.device_count():
                raise CheckpointError(
                    f"the checkpoint holds the RNG states of {len(states)} CUDA devices but this process "
                    f"sees {torch.cuda.device_count()}; resume with the same CUDA_VISIBLE_DEVICES"
                )
            torch.cuda.set_rng_state_all([s.to(torch.uint8).cpu() for s in states])

    def apply_again(self) -> None:
        """Set the generators to the loaded values once more (after a data loader drew from
        them while skipping to the saved position)."""
        if self.loaded is not None:
            self.load_state_dict(self.loaded)


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
        self.rng_at_start: dict[str, Any] | None = None
        self.generators_at_start: list[torch.Tensor] = []
        self.generators_saved: list[torch.Tensor] = []  # as loaded
        self.live: list[torch.Generator] = []  # the generators of the loader being iterated

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "rng_at_start": self.rng_at_start,
            "generators_at_start": list(self.generators_at_start),
            "generators": [g.get_state() for g in self.live],
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.epoch, self.batches = int(sd["epoch"]), int(sd["batches"])
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
