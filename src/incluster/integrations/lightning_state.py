"""How a Lightning checkpoint dict becomes incluster state, and back.

Lightning builds one dict per checkpoint (``Trainer._checkpoint_connector.dump_checkpoint``):
the model's ``state_dict``, a list of ``optimizer_states``, and everything else - loop
progress, callback states, LR scheduler states, hyper-parameters, precision-plugin and
datamodule state, whatever ``on_save_checkpoint`` hooks add. incluster stores:

- ``model``: the live model (or a Stateful view of its shards), restored in place;
- ``optimizer_<i>``: each live optimizer (or a Stateful view), restored in place, also
  when it has not stepped yet in the restoring process;
- ``lightning``: every other entry of the dict, as it is: nested dicts/lists/tuples,
  tensors and JSON scalars (anything else is refused, naming its path, unless the
  Checkpointer has ``allow_pickle=True``).

This module has no Lightning import: it works on plain dicts and torch objects.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


from incluster.errors import CheckpointError

MODEL = "model"
REST = "lightning"
LIVE_KEYS = ("state_dict", "optimizer_states")  # saved from the live objects, not the dict


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def to_state(checkpoint: Mapping[str, Any], model: Any, optimizers: Sequence[Any]) -> dict[str, Any]:
    """The incluster state for one Lightning checkpoint dict.

    WARNING: ``checkpoint["state_dict"]``/``["optimizer_states"]`` are not stored; the live
    ``model``/``optimizers`` are (what those entries were made from), so edits an
    ``on_save_checkpoint`` hook makes to those two entries are not kept."""
    rest = {k: v for k, v in checkpoint.items() if k not in LIVE_KEYS}
    state: dict[str, Any] = {MODEL: model, REST: _without_finished_loaders(rest)}
    for i, opt in enumerate(optimizers):
        state[optimizer_key(i)] = opt
    return state


def _without_finished_loaders(rest: dict[str, Any]) -> dict[str, Any]:
    """``rest`` without the train loaders' states when the epoch's last batch was taken.

    Lightning resumes such a checkpoint at the next epoch, and a resumable loader (a
    ``StatefulDataLoader``) restored as "epoch done" then yields nothing for that epoch:
    the resume would go on in the epoch after it. Without a state, the loader starts the
    next epoch afresh, as the uninterrupted run's did."""
    loops = rest.get("loops")
    if not isinstance(loops, dict) or not isinstance(fit := loops.get("fit_loop"), dict):
        return rest
    progress, inner = fit.get("epoch_loop.batch_progress"), fit.get("state_dict")
    if not (isinstance(progress, dict) and progress.get("is_last_batch") and isinstance(inner, dict)
            and "combined_loader" in inner):
        return rest
    inner = {k: v for k, v in inner.items() if k != "combined_loader"}
    return {**rest, "loops": {**loops, "fit_loop": {**fit, "state_dict": inner}}}


def template(model: Any, optimizers: Sequence[Any]) -> dict[str, Any]:
    """What ``Checkpointer.load`` restores into: the live parts, and an empty dict that
    receives the rest of the Lightning checkpoint."""
    return to_state({}, model, optimizers)


def to_checkpoint(state: Mapping[str, Any], model_state: dict[str, Any], optimizer_states: list[Any]) -> dict[str, Any]:
    """The Lightning checkpoint dict after ``load(state)``; ``model_state`` and
    ``optimizer_states`` are the live (just restored) states Lightning loads again."""
    rest = state[REST]
    if not isinstance(rest, dict) or "loops" not in rest:
        raise CheckpointError(
            "the incluster checkpoint has no Lightning trainer state ('lightning/loops'); it was not "
            "saved by incluster.integrations.lightning - load it with Checkpointer.load() directly"
        )
    checkpoint = dict(rest)
    checkpoint["state_dict"] = model_state
    checkpoint["optimizer_states"] = optimizer_states
    return checkpoint
