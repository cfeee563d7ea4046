"""Flatten a training state into named tensors plus a JSON tree (``state_load`` loads it back).

``flatten`` walks the user's state (Modules, Optimizers, anything Stateful, nested
dicts/lists/tuples, tensors, DTensors, JSON leaves) and returns the unique tensors to
store with their names, and a JSON tree that records every container, every leaf value
and which name each tensor slot refers to. Tensors that are the same view of the same
storage (tied weights) are stored once and referenced twice.

Tree nodes (JSON): ``{"T": name}`` tensor, ``{"D": name, ...placement}`` DTensor shard,
``{"P": name}`` pickled object (uint8 bytes, only with ``allow_pickle``),
``{"S": kind, "v": node}`` Stateful object's state_dict, ``{"d": [[key, node], ...]}``
dict, ``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"v": value}`` JSON scalar,
``{"f": float-or-"nan"/"inf"/"-inf"}`` float.
"""

from __future__ import annotations

import enum
import math
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NoReturn

import torch

from incluster import dtensor
from incluster.errors import CheckpointError
from incluster.format.dtypes import DTYPE_TO_NAME, dtype_name
from incluster.format.layout import TensorSpec
from incluster.format.tree import MAX_NODES
from incluster import guard

_SCALARS = (str, int, bool, type(None))
# The deepest nesting save() takes: a reader refuses a tree deeper than format.tree's
# MAX_DEPTH (200) as not written by incluster, and the tree is pickled to a writer
# process, four containers a level, under Python's recursion limit. The staging walk's own
# bound leaves room for what a module's or an optimizer's state_dict() adds below the
# level save() sees (an optimizer's parameter lists are three levels down).
MAX_SAVE_DEPTH = 100
_WALK_DEPTH = MAX_SAVE_DEPTH + 8


def _plain(obj: Any, as_value: bool = True) -> Any:
    """A JSON scalar as stored: an ``IntEnum``, a ``StrEnum``, a numpy float become the
    plain int, str or float they are (their class need not import where the tree goes:
    the writer process unpickles it); so do a plain ``Enum`` member whose value is one
    and any numpy scalar (``load()`` gives back the live value's type) - as values only
    (``as_value``): a dict key stored as such would not find the live dict's key on load,
    which neither equals nor hashes like it, so such a key stays what it is and is refused.
    Anything else is returned as it is."""
    cls = type(obj)
    if cls is str or cls is int or cls is float or cls is bool or obj is None:
        return obj
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int.__int__(obj)
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, float):
        return float.__float__(obj)
    if not as_value:
        return obj
    if isinstance(obj, enum.Enum):  # a plain Enum member: its value, where that is a JSON scalar
        value = obj.value
        return value if type(value) in _JSON or value is None else obj
    if cls.__module__ == "numpy":  # a numpy scalar (np.float32, np.int64, np.bool_): its value
        import numpy as np

        if isinstance(obj, np.generic):
            value = obj.item()
            return value if type(value) in _JSON else obj
    return obj


_JSON = (str, int, float, bool)


def key_problem(key: Any) -> str | None:
    """Why a dict key (already :func:`_plain`) cannot be stored, else None."""
    if not isinstance(key, (str, int, float, bool, type(None))):
        return f"dict key {key!r} of type {type(key).__name__} cannot be stored; use str or int keys"
    if isinstance(key, float) and not math.isfinite(key):
        return f"dict key {key!r} cannot be stored (JSON has no {key!r}); use str or int keys"
    return None


@dataclass
class Flat:
    """The result of flattening: tensors to store, their specs, and the JSON tree."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    specs: list[TensorSpec] = field(default_factory=list)
    tree: Any = None
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    nbytes: int = 0


def escape_part(part: Any) -> str:
    return str(part).replace("%", "%25").replace("/", "%2F")


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _float_node(x: float) -> dict[str, Any]:
    if math.isnan(x):
        return {"f": "nan"}
    if math.isinf(x):
        return {"f": "inf" if x > 0 else "-inf"}
    return {"f": x}


ViewKey = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], torch.device]


def view_key(t: torch.Tensor) -> ViewKey:
    """One view of one storage: two tensors with this key hold the same values."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


class _Captured:
    """A Stateful object's ``state_dict()`` taken at save() time, walked later.

    Module and Optimizer state dicts are fresh containers whose tensors stay unchanged
    until the next ``optimizer.step()`` (which waits for staging), so they are walked on
    the staging thread. Module buffers change in forward (BatchNorm statistics), so they
    are cloned here, before save() returns.
    """

    __slots__ = ("kind", "sd", "buffers")

    def __init__(self, kind: str, sd: Any, buffers: dict[ViewKey, torch.Tensor]) -> None:
        self.kind, self.sd, self.buffers = kind, sd, buffers


class _Rejected(Exception):
    pass


class _Root:
    """What ``snapshot`` returns: the captured tree plus the save-time clones of the
    tensors no optimizer step guards (by view key; the flattener swaps them in)."""

    __slots__ = ("tree", "clones")

    def __init__(self, tree: Any, clones: dict[ViewKey, torch.Tensor]) -> None:
        self.tree, self.clones = tree, clones


def snapshot(
    state: Mapping[str, Any],
    *,
    allow_pickle: bool = False,
    guarded: Callable[[list[torch.optim.Optimizer]], set[int]] | None = None,
    clone_limit: int | None = None,
    clone: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[Any, list[torch.optim.Optimizer], list[torch.Tensor]]:
    """The cheap, synchronous half of a save: capture every value that may change next.

    Containers are rebuilt and JSON leaves captured; tensors are kept by reference, except
    those that may change before the next optimizer step: module buffers, and - when
    ``guarded`` says which data pointers only an optimizer step changes - every other
    tensor outside that set, cloned up to ``clone_limit`` bytes per save (default ``guard.CLONE_LIMIT``)
    by ``clone`` (default ``Tensor.clone``; the Checkpointer's :class:`guard.ClonePool`).
    Returns the snapshot, the optimizers found, and the unguarded tensors left uncloned.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"state must be a dict of named parts, e.g. {{'model': model, 'optim': optim}}, "
            f"not a {type(state).__name__}"
        )
    optimizers: list[torch.optim.Optimizer] = []
    bare: list[torch.Tensor] = []
    with torch.no_grad():
        try:
            tree = _capture(state, optimizers, allow_pickle, bare)
        except _Rejected:
            _refuse(state, allow_pickle)
        clones: dict[ViewKey, torch.Tensor] = {}
        left: list[torch.Tensor] = []
        try:
            _clone_unguarded(bare, guarded, optimizers, clone_limit, clones, left, clone)
        except RuntimeError:
            if any(t.is_nested for t in bare):  # torch cannot describe its views
                _refuse(state, allow_pickle)
            raise
    return _Root(tree, clones), optimizers, left


def _refuse(state: Mapping[str, Any], allow_pickle: bool) -> NoReturn:
    """save() refuses ``state``: walk it again with paths, raising the precise error."""
    try:
        flatten_snapshot(state, allow_pickle=allow_pickle, depth_limit=MAX_SAVE_DEPTH)
    except RecursionError:  # an object's own state_dict() nested past Python's limit (or a cycle)
        raise CheckpointError("save() cannot store this state: it is nested too deep, or a dict or list holds "
                              "itself; flatten it") from None
    raise CheckpointError(  # what the walk could not name (keys that merge inside an object's state_dict())
        "save() cannot store this state: a dict holds two keys that are one once stored as plain values "
        "(an int or str subclass beside its value); rename one")


def _clone_unguarded(bare: list[torch.Tensor], guarded: Callable[[list[torch.optim.Optimizer]], set[int]] | None,
                     optimizers: list[torch.optim.Optimizer], clone_limit: int | None,
                     clones: dict[ViewKey, torch.Tensor], left: list[torch.Tensor],
                     clone: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Clone into ``clones`` the tensors of ``bare`` that something other than an optimizer
    step may change before the copy (see :func:`snapshot`); ``left`` gets those over budget."""
    if guarded is None or not bare:
        return
    safe = guarded(optimizers)
    budget = guard.CLONE_LIMIT if clone_limit is None else clone_limit
    ptrs = list(map(torch.Tensor.data_ptr, bare))  # one C loop; most are guarded
    if safe.issuperset(ptrs):
        return
    for t in bare:
        ptr = t.data_ptr()
        if ptr == 0 or ptr in safe:
            continue
        key = view_key(t)
        if key in clones:
            continue
        if t.nbytes <= budget:
            clones[key] = t.detach().clone() if clone is None else clone(t)
            budget -= t.nbytes
        else:
            left.append(t)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STORABLE = frozenset(DTYPE_TO_NAME)  # others (complex) are refused in save(), by path (flatten_snapshot)
_SAVE_TO = torch.nn.Module._save_to_state_dict
_STATE_DICT = torch.nn.Module.state_dict


def _walk_module(module: torch.nn.Module) -> tuple[bool, list[torch.Tensor]]:
    """One pass over the module tree: its buffers (each once), and whether
    ``state_dict(keep_vars=True)`` may stand in for ``state_dict()`` (see :func:`_pinned`).
    Only where torch's own ``state_dict`` runs in the whole tree, with no state-dict
    post-hook and no ``_save_to_state_dict`` of a module's own: those see the tensors and
    may return other ones for ``keep_vars``. Pre-hooks run before any tensor is collected
    (FSDP2 registers one that puts the sharded parameters back), so they may stay."""
    keep = True
    bufs: dict[int, torch.Tensor] = {}
    todo, seen = [module], {id(module)}
    while todo:
        m = todo.pop()
        if keep and (m._state_dict_hooks or type(m).state_dict is not _STATE_DICT
                     or type(m)._save_to_state_dict is not _SAVE_TO):
            keep = False
        if m._buffers:
            bufs.update((id(b), b) for b in m._buffers.values() if b is not None)
        for c in m._modules.values():
            if c is not None and id(c) not in seen:  # shared submodules once
                seen.add(id(c))
                todo.append(c)
    return keep, list(bufs.values())


def _initialized(sd: Any, checked: bool = False) -> Any:
    """A lazy module (``LazyLinear``) holds no values before its first forward pass: say
    so in save(), not as a shape error when the staging thread reaches it."""
    from torch.nn.parameter import UninitializedTensorMixin as lazy  # type: ignore[attr-defined]
    for k, v in sd.items():
        if checked and isinstance(v, torch.Tensor) and (v.dtype not in _STORABLE or v.is_meta
                                                        or v.layout is not torch.strided):
            raise _Rejected
        if isinstance(v, lazy):
            raise CheckpointError(
                f"{k}: an uninitialized parameter of a lazy module (LazyLinear, ...) holds no values yet; run "
                f"one forward pass (or load() into the module) before saving it")
    return sd


def _pinned(sd: Any, checked: bool = False) -> Any:
    """``state_dict(keep_vars=True)`` made to hold what ``state_dict()`` would: an alias
    of each tensor (a later ``param.data = ...`` or ``model.half()`` must not change what
    is saved), cheaper than ``state_dict()``'s own walk: a bare ``detach()`` for a plain
    tensor, a DTensor as its local shard and spec (no dispatch: ~30 us saved each)."""
    for k, v in sd.items():  # values only: the dict (and its _metadata) stays
        cls = type(v)
        if checked and isinstance(v, torch.Tensor) and (v.dtype not in _STORABLE or v.is_meta
                                                        or v.layout is not torch.strided):
            raise _Rejected  # a module on the meta device, a sparse buffer: named by the walk
        if cls is torch.nn.Parameter or cls is torch.Tensor:
            sd[k] = v.detach()
        elif isinstance(v, torch.Tensor):
            sd[k] = dtensor.Pinned(v) if dtensor.is_dtensor(v) else v.detach()
    return sd


def _capture(
    obj: Any, optimizers: list[torch.optim.Optimizer], allow_pickle: bool = True, bare: list[torch.Tensor] | None = None,
    depth: int = 0,
) -> Any:
    """Raises _Rejected for what save() refuses at once: the caller walks again with paths
    (flatten_snapshot), whose error names the value and the fix."""
    if isinstance(obj, torch.Tensor):
        if bare is not None and (
            type(obj).__name__ == "ShardedTensor" or obj.layout is not torch.strided or obj.is_meta
            or obj.dtype not in _STORABLE or obj.is_nested
        ):
            raise _Rejected  # walked again with paths: the error names it and the fix
        if bare is not None and obj.numel():
            bare.append(obj)
        return obj
    if isinstance(obj, (str, int, float, type(None))):
        return _plain(obj)
    if isinstance(obj, enum.Enum) or type(obj).__module__ == "numpy":
        value = _plain(obj)
        if value is not obj:
            return value
    checked = bare is not None  # save(): refused here (the flattener's own walk says why)
    if checked and depth >= MAX_SAVE_DEPTH and (
            isinstance(obj, (Mapping, list, tuple, torch.nn.Module, torch.optim.Optimizer)) or is_stateful(obj)):
        raise _Rejected
    if isinstance(obj, Mapping):
        out = {}
        converted = False
        for k, v in obj.items():
            if type(k) is not str and type(k) is not int:
                k, converted = _plain(k, False), True
                if checked and key_problem(k) is not None:
                    raise _Rejected
            if converted and checked and k in out:  # a key stored as its plain value beside that value
                raise _Rejected
            # the common leaf inline (a flat state dict of thousands of tensors: no call each)
            if type(v) in _PLAIN and v.layout is torch.strided and not v.is_meta and v.dtype in _STORABLE:
                if bare is not None and v.numel():
                    bare.append(v)
                out[k] = v
            else:
                out[k] = _capture(v, optimizers, allow_pickle, bare, depth + 1)
        return out
    if checked and isinstance(obj, (list, tuple)) and len(obj) >= MAX_NODES:
        raise _Rejected
    if isinstance(obj, list):
        return [_capture(v, optimizers, allow_pickle, bare, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_capture(v, optimizers, allow_pickle, bare, depth + 1) for v in obj)
    if isinstance(obj, torch.nn.Module):
        keep, bufs = _walk_module(obj)
        checked = bare is not None  # save(): a tensor the shard cannot hold is refused there, not later
        sd = _pinned(obj.state_dict(keep_vars=True), checked) if keep else _initialized(obj.state_dict(), checked)
        buffers: dict[ViewKey, torch.Tensor] = {}
        if bufs:
            # Only buffers the state dict holds: non-persistent ones are not saved, so not copied
            # (a non-persistent view of a saved buffer shares its pointer, not its view key).
            # Pointers first: a view key costs ~6 us, and a state dict holds thousands of tensors.
            # A sparse buffer has no data pointer: left out (one the state dict holds is refused).
            bufs = [b for b in bufs if b.layout is torch.strided and b.numel() > 0]
            ptrs = {b.data_ptr() for b in bufs}
            saved = {view_key(v) for v in sd.values()
                     if isinstance(v, torch.Tensor) and v.layout is torch.strided and v.data_ptr() in ptrs}
            for b in bufs:
                if (key := view_key(b)) in saved:
                    buffers[key] = b.clone()
        return _Captured("module", sd, buffers)
    if isinstance(obj, torch.optim.Optimizer):
        optimizers.append(obj)
        return _Captured("optimizer", obj.state_dict(), {})
    if is_stateful(obj):
        return _Captured("stateful", _capture(obj.state_dict(), optimizers, allow_pickle, bare, depth + 1), {})
    if not allow_pickle:
        raise _Rejected
    return obj  # pickled by flatten


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.flat = Flat()
        self.seen: dict[tuple[Any, ...], str] = {}
        self.names: set[str] = set()
        self.buffers: dict[ViewKey, torch.Tensor] = {}
        self.nodes = 0  # tree nodes, tensors included (format.tree.MAX_NODES bounds them)
        self.depth_limit = _WALK_DEPTH

    def add_tensor(self, t: torch.Tensor, name: str) -> str:
        if t.is_nested:
            raise CheckpointError(
                f"{name}: a nested tensor cannot be stored (a shard holds dense tensors); save its parts "
                f"(t.unbind()) or a padded one (t.to_padded_tensor(0))")
        if t.is_quantized:
            raise CheckpointError(
                f"{name}: a quantized tensor ({t.dtype}) cannot be stored; save t.int_repr() with its "
                f"scale and zero point, or t.dequantize()")
        if t.layout is not torch.strided:
            raise CheckpointError(
                f"{name}: a {t.layout} tensor cannot be stored (a shard holds dense tensors); save "
                f"t.to_dense(), or its parts (t.indices() and t.values() for a sparse COO tensor)"
            )
        if t.is_meta:
            raise CheckpointError(
                f"{name}: a tensor on the meta device holds no values to save; materialize the module "
                f"first (module.to_empty(device=...) and initialize it, or load() into it)"
            )
        shape = tuple(t.shape)
        ptr = t.data_ptr()
        if ptr:
            key = (ptr, t.dtype, shape, t.stride(), t.device)
            prior = self.seen.get(key)
            if prior is not None:
                return prior  # same view of the same storage: store once (tied weights)
            self.seen[key] = name
            clone = self.buffers.get(key)
            if clone is not None:
                t = clone  # the value this view had when save() was called
        if name in self.names:
            raise CheckpointError(
                f"{name}: two different values flatten to the same name; rename one of the keys "
                f"(keys are joined with '/', and 0 and '0' are the same name)"
            )
        self.names.add(name)
        spec = TensorSpec(name, dtype_name(t.dtype, name), shape)
        self.flat.tensors.append(t)
        self.flat.specs.append(spec)
        self.flat.nbytes += t.nbytes
        return name

    def _dtensor(self, dt: Any, path: str) -> dict[str, Any]:
        """A DTensor (or its :class:`dtensor.Pinned` capture): the local shard and placement."""
        return {"D": self.add_tensor(dtensor.local_of(dt), path), **dtensor.describe(dt)}

    def walk(self, obj: Any, path: str, depth: int = 0, limit: int | None = None) -> Any:
        """``limit``: the depth bound here (save()'s does not reach into the state dict of a
        module or an optimizer, which save() does not walk)."""
        self.nodes += 1
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:  # the common case, first
            return {"T": self.add_tensor(obj, path)}
        if self.nodes > MAX_NODES:
            raise too_many(path)
        if isinstance(obj, torch.Tensor):
            if type(obj).__name__ == "ShardedTensor":
                raise CheckpointError(
                    f"{path}: a ShardedTensor (FSDP1 without a DeviceMesh) cannot be checkpointed; give "
                    f"FSDP a device_mesh (Lightning: FSDPStrategy(device_mesh=(1, world_size))) so its "
                    f"state dict holds DTensors, or use FSDP2 (fully_shard)"
                )
            if dtensor.is_dtensor(obj):
                return self._dtensor(obj, path)
            return {"T": self.add_tensor(obj, path)}
        if cls is dtensor.Pinned:  # a module's DTensor, as save() found it
            return self._dtensor(obj, path)
        if isinstance(obj, bool) or isinstance(obj, _SCALARS):
            return {"v": _plain(obj)}
        if isinstance(obj, float):
            return _float_node(_plain(obj))
        if isinstance(obj, enum.Enum) or cls.__module__ == "numpy":
            value = _plain(obj)
            if value is not obj:
                return self.walk(value, path, depth, limit)
        limit = self.depth_limit if limit is None else limit
        if depth >= limit and (isinstance(obj, (Mapping, list, tuple, _Captured)) or is_stateful(obj)):
            raise CheckpointError(
                f"{path[:60]}/.../{path[-40:]}: the state is nested deeper than {MAX_SAVE_DEPTH} levels of dicts, "
                f"lists and objects, deeper than a checkpoint can be read back with; flatten it (e.g. join the "
                f"inner keys)")
        if isinstance(obj, Mapping):
            items: list[list[Any]] = []
            seen: set[Any] = set()
            for k, v in obj.items():
                k = _plain(k, False)
                why = key_problem(k) or (f"dict key {k!r} appears twice once keys are stored as plain values "
                                         f"(an enum member and its value?); rename one" if k in seen else None)
                if why is not None:
                    raise CheckpointError(f"{path or '<state>'}: {why}")
                seen.add(k)
                items.append([k, self.walk(v, f"{path}/{escape_part(k)}" if path else escape_part(k), depth + 1, limit)])
            return {"d": items}
        if isinstance(obj, (list, tuple)):
            tag = "t" if isinstance(obj, tuple) else "l"
            return {tag: [self.walk(v, f"{path}/{i}", depth + 1, limit) for i, v in enumerate(obj)]}
        if isinstance(obj, _Captured):
            self.buffers.update(obj.buffers)
            inner = max(limit, _WALK_DEPTH) if obj.kind in ("module", "optimizer") else limit
            return {"S": obj.kind, "v": self.walk(obj.sd, path, depth + 1, inner)}  # two tree levels, as save() counts
        if is_stateful(obj):
            return self.walk(_capture(obj, self.flat.optimizers), path, depth, limit)
        if self.allow_pickle:
            try:
                data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:  # noqa: BLE001 - whatever pickle raises: the object cannot be stored
                raise CheckpointError(f"{path}: cannot pickle a {type(obj).__module__}.{type(obj).__qualname__} "
                                      f"({type(exc).__name__}: {exc}); leave it out of the state") from None
            return {"P": self.add_tensor(torch.frombuffer(data, dtype=torch.uint8), path)}
        import torch.utils.data as tud

        if isinstance(obj, tud.DataLoader):
            raise CheckpointError(
                f"{path}: a plain torch DataLoader has no state to save (its position is not "
                f"restorable, and pickling it would store its whole dataset); use a stateful one - "
                f"torchdata.stateful_dataloader.StatefulDataLoader is a drop-in replacement - or leave it out "
                f"and keep the position yourself (e.g. the step in a dict)"
            )
        raise CheckpointError(
            f"{path}: cannot checkpoint a {type(obj).__module__}.{type(obj).__qualname__}; store "
            f"tensors, Modules, Optimizers, objects with state_dict()/load_state_dict(), "
            f"dicts/lists and JSON scalars, or pass allow_pickle=True if you trust every loader"
        )


def flatten(state: Mapping[str, Any], *, allow_pickle: bool = False) -> Flat:
    """Snapshot and flatten ``state`` in one go. Raises CheckpointError naming the path."""
    snap, optimizers, _ = snapshot(state, allow_pickle=allow_pickle)
    flat = flatten_snapshot(snap, allow_pickle=allow_pickle)
    flat.optimizers = optimizers
    return flat


def flatten_snapshot(snap: Any, *, allow_pickle: bool = False, depth_limit: int = _WALK_DEPTH) -> Flat:
    """The slow half of a save (staging thread): names, specs, tied tensors, the tree.
    ``depth_limit``: save()'s own (MAX_SAVE_DEPTH) when it walks a state it refused."""
    f = _Flattener(allow_pickle)
    f.depth_limit = depth_limit
    if isinstance(snap, _Root):
        f.buffers.update(snap.clones)
        snap = snap.tree
    with torch.no_grad():
        f.flat.tree = f.walk(snap, "")
    if f.nodes > MAX_NODES:  # tensors last: counted, but the walk checks at the next other value
        raise too_many("<state>")
    return f.flat


def too_many(path: str) -> CheckpointError:
    return CheckpointError(
        f"{path or '<state>'}: the state holds more than {MAX_NODES:,} values (tensors, lists, dicts, numbers), "
        f"more than a checkpoint can be read back with; keep long lists of numbers as tensors (torch.tensor(values))")
