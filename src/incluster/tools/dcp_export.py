"""``incluster export ... --to dcp OUT``: a standard torch.distributed.checkpoint folder.

The export rebuilds the *nested* state each rank saved (the same dicts, lists and
``state_dict()`` values its Modules and Optimizers returned), with every DTensor assembled
from its shards into one full tensor, and hands it to ``dcp.save`` in this one process.
DCP flattens it exactly as it flattens the live state a job passes to ``dcp.load``, so
``dcp.load({"model": model, "optim": optim}, checkpoint_id=OUT)`` finds every key, and
DCP reshards the full tensors into whatever DTensor layout the loading job uses (any
world size, any mesh).

Values that only some ranks hold (a per-rank data loader position) are taken from the
lowest rank that holds them, as ``export --to safetensors`` does. Pickled objects are
refused: writing them for DCP would mean unpickling them here.

Memory: the whole state is assembled in this process (as for the other export formats).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from incluster.errors import CheckpointError
from incluster.state import escape_part
from incluster.tools.export import Assembled


def _child(path: str, part: str) -> str:
    return f"{path}/{part}" if path else part


class _Nester:
    """Walks every rank's state tree, rank 0 first, into one nested Python object."""

    def __init__(self, assembled: Assembled) -> None:
        self.tensors = assembled.tensors

    def build(self, node: Any, path: str, into: Any = None) -> Any:
        if not isinstance(node, dict):
            raise CheckpointError(f"malformed state tree at {path or '<root>'}")
        if "T" in node or "D" in node:
            if path not in self.tensors:
                raise CheckpointError(f"{path}: no assembled tensor for this path")
            return self.tensors[path]
        if "P" in node:
            raise CheckpointError(
                f"{path}: a pickled object; export --to dcp would have to unpickle it (which can run "
                f"code). Export with --to safetensors or --to torch, or save it as tensors/JSON values"
            )
        if "S" in node:
            return self.build(node.get("v"), path, into)
        if into is not None and not _same_kind(node, into):
            return into  # a lower rank holds something else here: the lowest rank's value wins
        if "d" in node:
            out = into if isinstance(into, dict) else {}
            for key, child in node["d"]:
                out[key] = self.build(child, _child(path, escape_part(key)), out.get(key))
            return out
        if "l" in node or "t" in node:
            items = node.get("l", node.get("t")) or []
            if into is not None and len(into) != len(items):
                return into
            have = list(into) if into is not None else [None] * len(items)
            built = [self.build(child, _child(path, str(i)), old) for i, (child, old) in enumerate(zip(items, have))]
            return tuple(built) if "t" in node else built
        if "v" in node:
            return node["v"] if into is None else into  # the lowest rank's value wins
        if "f" in node:
            return float(node["f"]) if into is None else into
        raise CheckpointError(f"unknown state tree node at {path or '<root>'}: {sorted(node)}")


def _same_kind(node: dict[str, Any], value: Any) -> bool:
    if "d" in node:
        return isinstance(value, dict)
    if "l" in node or "t" in node:
        return isinstance(value, (list, tuple))
    return True


def nested_state(trees: dict[int, Any], assembled: Assembled) -> dict[str, Any]:
    """The state as the job held it (full tensors), merged over ranks, lowest rank first."""
    nester = _Nester(assembled)
    state: Any = None
    for rank in sorted(trees):
        state = nester.build(trees[rank], "", state)
    if not isinstance(state, dict):
        raise CheckpointError("the saved state is not a dict at its top level")
    return {str(k): v for k, v in state.items()}


def write_dcp(state: dict[str, Any], out: str) -> list[str]:
    """``dcp.save`` into ``OUT.partial-PID``, then rename to ``OUT``: no half-written folder
    ever carries the final name."""
    import torch.distributed.checkpoint as dcp

    if os.path.exists(out):
        raise FileExistsError(f"{out} already exists; remove it or choose another OUT")
    tmp = f"{out}.partial-{os.getpid()}"
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, thread_count=2), no_dist=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [os.path.join(out, name) for name in sorted(os.listdir(out))]
