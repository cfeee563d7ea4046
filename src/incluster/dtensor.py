"""DTensor support: save the local shard with its placement, check it on load.

Kept apart so the rest of the package never imports torch.distributed.tensor unless a
DTensor is actually present in the state.
"""

from __future__ import annotations

from typing import Any

import torch

from incluster.errors import CheckpointError


def is_dtensor(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def local_of(dt: Any) -> torch.Tensor:
    """The local shard (shares storage with the DTensor)."""
    return dt._local_tensor


class Pinned:
    """A DTensor as ``save()`` found it, without ``DTensor.detach()`` (dispatched, ~30 us
    each): an alias of its local shard, so a later ``param.data = ...`` or FSDP putting
    a new local tensor in place cannot change what is saved, and its spec."""

    __slots__ = ("_local_tensor", "_spec")

    def __init__(self, dt: Any) -> None:
        self._local_tensor = dt._local_tensor.detach()
        self._spec = dt._spec

    @property
    def shape(self) -> Any:
        return self._spec.shape

    @property
    def device_mesh(self) -> Any:
        return self._spec.mesh

    @property
    def placements(self) -> Any:
        return self._spec.placements


def _placement_json(p: Any) -> list[Any]:
    name = type(p).__name__
    if name in ("Shard", "_StridedShard"):
        if name == "_StridedShard":
            return ["SS", p.dim, p.split_factor]
        return ["S", p.dim]
    if name == "Replicate":
        return ["R"]
    if name in ("Partial", "_Partial", "NormPartial", "MaskPartial"):
        return ["P", str(getattr(p, "reduce_op", "sum"))]
    return ["?", repr(p)]


def describe(dt: Any) -> dict[str, Any]:
    """JSON-able placement metadata: mesh shape, placements, global shape and offset."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dt.device_mesh
    global_shape = list(dt.shape)
    _, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dims": list(mesh.mesh_dim_names or []),
        "placements": [_placement_json(p) for p in dt.placements],
        "global_shape": global_shape,
        "global_offset": [int(o) for o in offset],
        "local_shape": list(local_of(dt).shape),
    }


def check_compatible(live: Any, saved: dict[str, Any], path: str) -> None:
    """Raise unless ``live`` is laid out exactly as the saved shard was."""
    if not is_dtensor(live):
        raise CheckpointError(
            f"{path}: the checkpoint holds a DTensor shard but the live value is a {type(live).__name__}; "
            f"build the model with the same parallelism before loading, or assemble a full state "
            f"with `incluster export`"
        )
    now = describe(live)
    for key in ("global_shape", "placements", "mesh_shape", "global_offset", "local_shape"):
        if now[key] != saved.get(key):
            raise CheckpointError(
                f"{path}: DTensor {key} is {now[key]} now but {saved.get(key)} in the checkpoint; "
                f"loading into a different sharding is not supported in place - assemble a full "
                f"state with `incluster export DIR --step N` and load that"
            )
