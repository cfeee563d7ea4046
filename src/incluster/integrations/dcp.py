"""Start an incluster job from a torch.distributed.checkpoint (DCP) checkpoint.

A job moving to incluster often has DCP checkpoints already (or a seed checkpoint, or
one written by ``incluster export --to dcp``). :func:`load_dcp` loads one into the same
live ``state`` dict the job passes to ``Checkpointer.save``/``load``, in place, with DCP's
own resharding (any saved world size or mesh into the job's current one)::

    start = ckpt.load(state)                      # newest incluster step, if any
    if start is None:
        start = load_dcp(state, "/ckpt/step-1000", step=1000)

It is collective when a process group is initialized (every rank calls it), as
``dcp.load`` is. On top of a plain ``dcp.load(state, checkpoint_id=path)`` it:

- gives optimizers that have not stepped yet their state tensors first (otherwise DCP
  finds no ``exp_avg`` to load into and silently leaves the moments at zero);
- refuses, naming the keys, a checkpoint that lacks something ``state`` holds, or holds
  a top-level entry ``state`` does not name (``strict=False`` loads what matches);
- reads local paths and fsspec URLs (``s3://...``);
- says which tensors it cast to the live state's dtype, and warns where the cast loses
  values (a float32 checkpoint into a bfloat16 model): DCP casts without a word, while
  incluster's own ``load`` refuses another dtype.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Mapping

import torch

from incluster.errors import CheckpointError, NoCheckpointError

log = logging.getLogger("incluster")


def _reader(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    if "://" in path and not path.startswith("file://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
    return dcp.FileSystemReader(path.removeprefix("file://"))


def _metadata(path: str) -> Any:
    try:
        return _reader(path).read_metadata()
    except FileNotFoundError as exc:
        raise NoCheckpointError(f"no DCP checkpoint at {path}: {exc}") from None


def stored_keys(path: str) -> list[str]:
    """The flattened keys (``model.layers.0.weight``) a DCP checkpoint holds."""
    return sorted(_metadata(path).state_dict_metadata)


def _fill_containers(state: Mapping[str, Any], meta: Any) -> None:
    """Give plain dicts in ``state`` the entries the checkpoint holds and they lack.

    DCP loads only into keys the live state already has; an empty ``{"extra": {}}`` would
    come back empty, silently. incluster's own ``load`` fills such containers, so this does
    too: tensors as empty tensors of the stored shape and dtype, other values as None, at
    the paths DCP recorded (``planner_data``). A list position no key names held an empty
    container (DCP stores nothing for one): it comes back as ``{}``. A path's key names a
    dict's key as its ``str()`` (an optimizer's ``state`` is keyed 0, 1, ...)."""
    paths = getattr(meta, "planner_data", None)
    if not isinstance(paths, dict):
        return
    gaps: dict[int, list[Any]] = {}  # lists filled here, by id: their unnamed positions become {} at the end
    keys: dict[int, dict[str, Any]] = {}  # id of a dict -> its keys by str() (DCP's path names them so)
    for fqn, item in meta.state_dict_metadata.items():
        path = paths.get(fqn)
        if not isinstance(path, tuple) or len(path) < 2 or not isinstance(state.get(path[0]), dict):
            continue
        size = getattr(item, "size", None)
        leaf = None if size is None else torch.empty(size, dtype=item.properties.dtype)
        node: Any = state[path[0]]
        for i, part in enumerate(path[1:], 1):  # an int part is a list index (DCP flattens lists so)
            last = i == len(path) - 1
            made: Any = leaf if last else ([] if isinstance(path[i + 1], int) else {})
            if isinstance(made, list):
                gaps[id(made)] = made
            if isinstance(node, dict) and not isinstance(part, int):
                part = _key_of(node, part, keys)
                if part not in node:
                    node[part] = made
                    keys.setdefault(id(node), {})[part] = part
            elif isinstance(node, list) and isinstance(part, int):
                if part >= len(node):
                    node.extend([_GAP] * (part + 1 - len(node)))
                    gaps[id(node)] = node
                if node[part] is _GAP:
                    node[part] = made
            else:
                break  # the live state has another shape here: DCP loads what fits, as it would
            node = node[part]
    for made in gaps.values():
        made[:] = [{} if v is _GAP else v for v in made]


_GAP = object()  # a list position no stored key has reached (yet)


def _key_of(node: Mapping[Any, Any], part: str, keys: dict[int, dict[str, Any]] | None = None) -> Any:
    """The key of ``node`` that DCP's path names ``part`` (its ``str()``), else ``part``;
    ``keys``: the dicts' keys by ``str()``, kept across calls (one pass over each dict)."""
    if part in node:
        return part
    index = None if keys is None else keys.get(id(node))
    if index is None:
        index = {str(k): k for k in node}
        if keys is not None:
            keys[id(node)] = index
    return index.get(part, part)


def _noting_planner(casts: dict[str, tuple[torch.dtype, torch.dtype]]) -> Any:
    """DCP's default load planner, noting each tensor whose saved dtype is not its live
    tensor's (DCP copies, so casts, into the live tensor)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Noting(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            # An empty dict or list the checkpoint has no key for holds nothing to load; DCP
            # stores none for one inside a list, yet refused it at load ("Missing key
            # extra.l.0"), even in the very structure it saved.
            stored = self.metadata.state_dict_metadata if self.metadata is not None else {}
            mappings = getattr(self, "mappings", {})
            for fqn in [k for k in self.state_dict if k not in stored and k in mappings]:
                if _empty_container(self.original_state_dict, mappings[fqn]):
                    del self.state_dict[fqn]
            return super().create_local_plan()

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            dest = super().resolve_tensor(read_item)
            fqn = read_item.dest_index.fqn
            stored = self.metadata.state_dict_metadata.get(fqn) if self.metadata is not None else None
            saved = getattr(getattr(stored, "properties", None), "dtype", None)
            if isinstance(saved, torch.dtype) and saved != dest.dtype:
                casts[fqn] = (saved, dest.dtype)
            return dest  # type: ignore[no-any-return]

    return Noting()


def _empty_container(root: Any, path: tuple[Any, ...]) -> bool:
    """Whether ``path`` (DCP's, keys and list indices) leads to an empty dict or list."""
    node = root
    for part in path:
        try:
            node = node[part] if isinstance(node, (list, tuple)) else node[_key_of(node, part)]
        except (KeyError, IndexError, TypeError):
            return False
    return isinstance(node, (Mapping, list)) and not node


def _lossy(saved: torch.dtype, live: torch.dtype) -> bool:
    """Whether casting ``saved`` values to ``live`` can change one (int64 -> float32 rounds
    above 2**24; bfloat16 -> float32 is exact)."""
    if saved.is_floating_point and not live.is_floating_point:
        return True
    if live.is_floating_point and not saved.is_floating_point and saved is not torch.bool and not saved.is_complex:
        mantissa = round(-math.log2(torch.finfo(live).eps))  # float32: 23 bits, exact integers up to 2**24
        return torch.iinfo(saved).max > 2 ** (mantissa + 1)
    return torch.promote_types(saved, live) != live


def _say_casts(path: str, casts: dict[str, tuple[torch.dtype, torch.dtype]]) -> None:
    if not casts:
        return
    lossy = sorted(k for k, (saved, live) in casts.items() if _lossy(saved, live))
    pairs = sorted({f"{str(a).removeprefix('torch.')} -> {str(b).removeprefix('torch.')}" for a, b in casts.values()})
    if lossy:
        log.warning("incluster: load_dcp cast %d tensor(s) of %s to the live state's dtypes (%s), losing precision "
                    "or range in %d: %s%s. Load into a state of the saved dtypes (and cast after) to keep every value",
                    len(casts), path, ", ".join(pairs), len(lossy), ", ".join(lossy[:5]),
                    f" and {len(lossy) - 5} more" if len(lossy) > 5 else "")
    else:
        log.info("incluster: load_dcp cast %d tensor(s) of %s to the live state's wider dtypes (%s), exactly",
                 len(casts), path, ", ".join(pairs))


def _prepare_optimizers(state: Mapping[str, Any], keys: list[str]) -> None:
    from incluster.state_load import init_optimizer_state

    for name, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer) and not obj.state:
            if any(k.startswith(f"{name}.state.") for k in keys):
                init_optimizer_state(obj)


def _top(fqn: str, meta: Any, state: Mapping[str, Any]) -> str:
    """The top-level entry a stored key belongs to. Top-level names may hold dots (a flat
    ``model.state_dict()``): DCP's recorded path says, else the longest matching name."""
    path = (getattr(meta, "planner_data", None) or {}).get(fqn)
    if isinstance(path, tuple) and path:
        return str(path[0])
    names = [k for k in state if fqn == k or fqn.startswith(f"{k}.")]
    return max(names, key=len) if names else fqn.split(".", 1)[0]


# an optimizer state dict keyed by parameter name ("optim.state.0.weight.exp_avg": the
# name holds a dot, or is not a number), not by index ("optim.state.0.exp_avg")
_BY_NAME = re.compile(r"^[^.]+\.state\.(?:[^.]+\.[^.]+\.|(?!\d+\.)[^.]+\.).+")


def _what_it_holds(why: str, keys: list[str], tops: set[str]) -> str:
    """The checkpoint's keys under the entry a missing or unexpected key names (a model
    saved as a Sequential, loaded as a Linear: ``model.0.weight`` against ``model.weight``),
    else its top-level entries."""
    m = re.search(r"key in checkpoint state_dict: ([^\s,]+?)\.?$|key.*?: ([^\s,]+?)\.?$", why)
    name = next((g for g in m.groups() if g), None) if m else None
    top = name.split(".", 1)[0] if name else None
    if top in tops:
        under = [k for k in keys if k == top or k.startswith(top + ".")]
        shown = ", ".join(under[:8]) + (f", ... ({len(under)} in all)" if len(under) > 8 else "")
        return f"Under {top!r} it holds: {shown}"
    return f"Its entries are {sorted(tops)}"


def load_dcp(state: dict[str, Any], path: str, *, step: int | None = None, strict: bool = True) -> int | None:
    """Load the DCP checkpoint at ``path`` into ``state`` in place; return ``step``.

    ``state`` is the dict the job checkpoints with incluster: Modules, Optimizers, objects
    with ``state_dict()``/``load_state_dict()``, tensors/DTensors and nested containers."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    meta = _metadata(path)
    keys = sorted(meta.state_dict_metadata)
    tops = {_top(k, meta, state) for k in keys}
    extra = sorted(tops - set(state))
    if strict and extra:
        raise CheckpointError(
            f"{path} holds entries {extra} that the state passed does not name (it names "
            f"{sorted(state)}); add them to the state, or pass strict=False to load only what matches"
        )
    _prepare_optimizers(state, keys)
    _fill_containers(state, meta)
    if not strict:
        # DCP refuses a live key the checkpoint lacks; load only the entries it has.
        part = {k: v for k, v in state.items() if k in tops}
        if not part:
            raise CheckpointError(f"{path} holds none of the state's entries {sorted(state)} (it holds {sorted(tops)})")
    else:
        part = state
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    try:
        dcp.load(part, storage_reader=_reader(path), planner=_noting_planner(casts),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    except (RuntimeError, CheckpointException) as exc:  # name what does not match
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = lines[-1] if lines else type(exc).__name__  # DCP wraps the cause in every rank's traceback
        named = sorted({top for k in keys if _BY_NAME.match(k) and isinstance(state.get(top := k.split(".", 1)[0]),
                                                                               torch.optim.Optimizer)})
        hint = (f" {named} key(s) optimizer state by parameter name, as get_state_dict() (and torchtitan) "
                f"save it: put the dicts of torch.distributed.checkpoint.state_dict.get_state_dict(model, optim) "
                f"in the state, and after load_dcp() hand them back with set_state_dict()"
                if named and "Missing key" in why else "")
        raise CheckpointError(
            f"loading the DCP checkpoint {path} into this state failed: {why.rstrip('.')}. "
            f"{_what_it_holds(why, keys, tops)}; load with the same structure it was saved with.{hint}"
        ) from exc
    _say_casts(path, casts)
    if part is not state:
        state.update(part)
    return step
