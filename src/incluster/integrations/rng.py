"""The process's random number generators as a Stateful object incluster stores without
pickle (tensors and JSON scalars): Python's, NumPy's, torch's CPU generator and every CUDA
device's. Shared by the Lightning and Hugging Face integrations. Imports no framework."""

from __future__ import annotations

import random
from typing import Any, Mapping

import torch

from incluster.errors import CheckpointError

__all__ = ["RngState"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


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


def refuse_resize(ckpt: Any, why: str) -> None:
    """After a framework's ``load()``: a step saved by another number of processes cannot
    continue the saved run (``why``), so say so now rather than train on other data. Set
    before the load (``Checkpointer._refuse_resize``), the restore itself refuses such a
    step before any byte lands, with this same message."""
    report = getattr(ckpt, "last_restore", None)
    if report is None or report.source != "reshard" or report.old_world is None:
        return
    raise CheckpointError(resize_refusal(report.step, report.old_world, ckpt.world_size, why,
                                         getattr(getattr(ckpt, "config", None), "job", None)))


def resize_refusal(step: int | None, old: int, new: int, why: str, job: str | None = None) -> str:
    named = "" if job is None else (
        f"; to start afresh instead, name another job (job=...; this one is {job!r}, and a job not named with "
        f"job= or INCLUSTER_JOB is named from the script and working folder, whatever the number of processes)")
    return (f"step {step} was saved by {old} process(es) and this run has {new}: {why}, so the run cannot go on "
            f"as the saved one. Resume with {old} process(es){named}; to change the number, load the model and "
            f"optimizer with a plain incluster.Checkpointer (or `incluster export --to dcp`) and start the loop afresh")
