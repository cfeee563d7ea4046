"""What the torchtitan checkpoint manager hands to incluster: the same states torchtitan's
DCP manager checkpoints, in the same layout.

torchtitan flattens the model's state into the top level of its checkpoint (``{fqn: tensor,
"optimizer": ..., "lr_scheduler": ..., "dataloader": ..., "train_state": ...}``); incluster
stores exactly that layout, so model FQNs and ``exclude_from_loading`` mean the same thing
in both. One value is adapted on the way: ``ParallelAwareDataloader.state_dict()`` pickles
its state into bytes (kept for DCP compatibility); incluster stores the same state as a
plain tree instead, so a restore never unpickles anything.

The optimizers container goes in as it is: incluster sees a ``torch.optim.Optimizer`` and
guards its parameters with the optimizer-step hook like any optimizer's; its flat state
dict (``state.<fqn>.exp_avg``...) is filled in place and handed to its
``load_state_dict``, whose own zero-lr step has materialized the inner state first.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from torchtitan.components.checkpointer.base import DATALOADER, MODEL
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchdata.stateful_dataloader import StatefulDataLoader


class DataloaderState:
    """A torchtitan data loader's state as a tree incluster stores without pickle.

    For a ``ParallelAwareDataloader`` (torchtitan's text and chat loaders): the same
    ``{"dp_rank_<r>": state, "world_size": n}`` its ``state_dict()`` returns, with the
    inner ``StatefulDataLoader`` state kept as a dict rather than pickled bytes. Any other
    data loader passes through unchanged (if its state holds bytes, incluster refuses the
    save and names ``allow_pickle``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def _key(self) -> str:
        return f"dp_rank_{self.loader.dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        if not isinstance(self.loader, ParallelAwareDataloader):
            return dict(self.loader.state_dict())
        inner = StatefulDataLoader.state_dict(self.loader)
        return {self._key(): inner, "world_size": self.loader.dp_world_size}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        inner = state_dict.get(self._key()) if isinstance(self.loader, ParallelAwareDataloader) else None
        if not isinstance(inner, Mapping):
            self.loader.load_state_dict(dict(state_dict))  # another loader, or the pickled form
            return
        if state_dict.get("world_size") != self.loader.dp_world_size:
            raise ValueError(
                f"the checkpoint's data loader state was saved with {state_dict.get('world_size')} "
                f"data-parallel ranks, this job has {self.loader.dp_world_size}; torchtitan cannot reshard "
                f"it: resume with the same data-parallel degree, or add 'dataloader' to "
                f"checkpoint.exclude_from_loading to restart the data from its beginning"
            )
        StatefulDataLoader.load_state_dict(self.loader, dict(inner))


def incluster_states(states: Mapping[str, Any], *, exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The flat state torchtitan's DCP manager would save (or load), as incluster takes it.

    ``states``: the manager's ``states`` (``model`` is a ``ModelWrapper``). ``exclude``:
    top-level keys left out (``checkpoint.exclude_from_loading``). Empty parts (no data
    loader) are left out."""
    for key in exclude:
        if key not in states:
            raise ValueError(
                f"checkpoint.exclude_from_loading names {key!r}, which is not a checkpointed state "
                f"(they are {sorted(states)})"
            )
    out: dict[str, Any] = {}
    for key, value in states.items():
        if key == MODEL or key in exclude or value is None:
            continue
        if key == DATALOADER:
            value = DataloaderState(value)
        out[key] = value
    model = states[MODEL].state_dict()
    clash = sorted(set(model) & set(out))
    if clash:
        raise ValueError(f"model parameter names {clash} collide with checkpointed state names; rename them")
    out.update(model)
    return out

