"""Load a saved tree back into the live state, in place.

``load_into`` walks the live state alongside a saved tree (see ``state`` for its node
kinds) and copies stored bytes into the live tensors in place, rebuilding what does not
exist yet (an optimizer that has not stepped) and calling ``load_state_dict`` where the
object needs it. ``live_targets`` walks the same way without changing anything, to find
the live tensor each stored name lands in.
"""

from __future__ import annotations

import itertools
import logging
import pickle
from typing import Any, Callable, Mapping

import torch

from incluster import dtensor
from incluster.errors import CheckpointError
from incluster.state import escape_part, is_stateful

log = logging.getLogger("incluster")
_SAID_LEFT_OUT: set[tuple[Any, ...]] = set()  # each set of parts left out is said once per process

Fetch = Callable[[str], torch.Tensor]
# A load that fails for a reason of the live state, not of the copy (shape, dtype, keys, a
# load_state_dict that refuses): no other copy helps, so a restore stops every rank together.
CANNOT_LOAD = (CheckpointError, RuntimeError, ValueError, TypeError, KeyError, IndexError)


class _Loader:
    def __init__(
        self,
        fetch: Fetch,
        allow_pickle: bool,
        placed: Mapping[str, torch.Tensor] | None = None,
        collect: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.fetch = fetch
        self.allow_pickle = allow_pickle
        self.placed = placed or {}  # name -> memory that already holds its stored bytes
        self.collect = collect  # dry walk: record name -> live tensor, change nothing
        self.dtensors: dict[str, tuple[Any, str]] | None = None  # name -> (live DTensor, path)
        self._objects = 0  # how deep inside an object's state_dict the walk is (its own load_state_dict judges it)

    def value(self, node: Any, live: Any, path: str) -> Any:
        """Rebuild ``node``; tensors are copied into ``live`` in place when it fits."""
        if not isinstance(node, dict) or len(node) < 1:
            raise CheckpointError(f"{path}: malformed tree node in the checkpoint record")
        if "S" not in node and live is not None and not isinstance(live, torch.Tensor) and is_stateful(live):
            return self.into_stateful(node, live, path)
        if "S" in node:
            if live is None or not is_stateful(live):
                what = "nothing" if live is None else f"a {type(live).__module__}.{type(live).__qualname__}"
                saved = {"module": "a torch Module", "optimizer": "a torch Optimizer"}.get(
                    str(node["S"]), "an object with state_dict()/load_state_dict() (a stateful data loader, a scheduler...)")
                raise CheckpointError(
                    f"{path}: the checkpoint holds the state of {saved} here, but the live state has {what}, "
                    f"which cannot take it; pass an object of the kind that was saved")
            self.stateful(node, live, path)
            return live
        if "T" in node:
            return self.tensor(node["T"], live, path)
        if "D" in node:
            if self.dtensors is not None:  # only looking for the live DTensors
                if dtensor.is_dtensor(live):
                    self.dtensors[node["D"]] = (live, path)
                return live
            dtensor.check_compatible(live, node, path)
            self.tensor(node["D"], dtensor.local_of(live), path)
            return live
        if "v" in node:
            return _like(live, node["v"])
        if "f" in node:
            return _like(live, float(node["f"]))
        if "d" in node:
            return self.mapping(node["d"], live, path)
        if "l" in node or "t" in node:
            items: list[Any] = node["l"] if "l" in node else node["t"]
            lives = list(live) if isinstance(live, (list, tuple)) and len(live) == len(items) else [None] * len(items)
            out = [self.value(n, lv, f"{path}/{i}") for i, (n, lv) in enumerate(zip(items, lives))]
            if "t" in node and isinstance(live, tuple) and hasattr(type(live), "_fields") and len(live) == len(out):
                return type(live)(*out)  # a namedtuple stays one
            return tuple(out) if "t" in node else out
        if "P" in node:
            if not self.allow_pickle:  # the dry walk too: refused before any byte lands
                raise CheckpointError(
                    f"{path}: this checkpoint holds a pickled object; loading it can run code. Pass "
                    f"allow_pickle=True only if you trust whoever wrote this checkpoint"
                )
            if self.collect is not None:
                return None
            return pickle.loads(self.fetch(node["P"]).numpy().tobytes())
        raise CheckpointError(f"{path}: unknown tree node {sorted(node)} in the checkpoint record")

    def top(self, node: Any, live: Any, path: str) -> Any:
        """A value of the state passed to load(): one that is kept as it is (a tensor, which
        takes its bytes in place) must take the stored value, never drop it."""
        if isinstance(live, torch.Tensor) and isinstance(node, dict):
            kind = "a DTensor" if dtensor.is_dtensor(live) else "a tensor"
            pickled = "P" in node and not self.allow_pickle  # value() refuses it, saying why
            if not pickled and (not ({"T", "D"} & set(node)) or ("T" in node and dtensor.is_dtensor(live))):
                raise CheckpointError(
                    f"{path}: the checkpoint holds {_saved_kind(node)} here, but the live state has {kind}, "
                    f"which cannot take it; load with the layout it was saved with")
        return self.value(node, live, path)

    def into_stateful(self, node: Any, live: Any, path: str) -> Any:
        """A plain value saved where the live state has an object with load_state_dict()
        (a model saved as ``model.state_dict()``, loaded as the model): the object takes it
        through load_state_dict(), or the load is refused - never dropped. A saved None is
        nothing saved (an fp32 run's absent grad scaler): the object stays as it is."""
        if node.get("v", 0) is None:
            return live
        # A module's own tensors take the bytes in place, checked like any (load_state_dict
        # would cast fp32 into bf16), and found by the dry walk: refused before any byte lands.
        mine = live.state_dict() if isinstance(live, torch.nn.Module) and "d" in node else None
        if mine is not None and self.collect is not None:
            _refused_by_load_state_dict({"S": "module", "v": node}, live, mine, path)
        self._objects += 1
        try:
            restored = self.value(node, mine, path)
        finally:
            self._objects -= 1
        if self.collect is None:
            if mine is not None and _loaded_in_place(live, mine, restored):
                return live
            try:
                live.load_state_dict(restored)
            except Exception as exc:  # noqa: BLE001 - whatever it raises, it did not take it
                raise CheckpointError(
                    f"{path}: the checkpoint holds {_saved_kind(node)} here, which the live "
                    f"{type(live).__module__}.{type(live).__qualname__} cannot take ({type(exc).__name__}: "
                    f"{str(exc)[:300]}); pass what was saved") from exc
        return live

    def tensor(self, name: str, live: Any, path: str) -> torch.Tensor:
        plain = isinstance(live, torch.Tensor) and not dtensor.is_dtensor(live)
        if self.collect is not None:
            if plain:
                self.collect.setdefault(name, live)
            return live
        src = self.placed.get(name)
        if src is not None and plain and _same_memory(live, src):
            return live  # its bytes were written straight into this tensor
        if src is None:
            src = self.fetch(name)
        if isinstance(live, torch.Tensor) and not dtensor.is_dtensor(live):
            mismatch(path, live, src.dtype, tuple(src.shape))
            _copy_into(live, src, path)
            return live
        return src.clone()

    def mapping(self, items: list[Any], live: Any, path: str) -> dict[Any, Any]:
        live_map = live if isinstance(live, Mapping) else {}
        out: dict[Any, Any] = {}
        for key, child in items:
            sub = f"{path}/{escape_part(key)}" if path else escape_part(key)
            out[key] = self.value(child, live_map.get(key), sub)
        if self.collect is None and not self._objects and len(live_map) > len(out):
            extra = [k for k in live_map if k not in out]
            if extra and (path, tuple(map(str, extra))) not in _SAID_LEFT_OUT:
                _SAID_LEFT_OUT.add((path, tuple(map(str, extra))))
                log.warning("incluster: %s: the live dict has key(s) %s that the checkpoint does not; load() gives "
                            "back the dict as it was saved, without them", path or "<state>", extra[:8])
        return out

    def stateful(self, node: dict[str, Any], obj: Any, path: str) -> None:
        live_sd = obj.state_dict()
        if self.collect is not None:  # the dry walk: what load_state_dict would refuse, refused before any byte lands
            _refused_by_load_state_dict(node, obj, live_sd, path)
        self._objects += 1
        try:
            new_sd = self.value(node["v"], live_sd, path)
        finally:
            self._objects -= 1
        if self.collect is not None:
            return
        if node["S"] == "module" and _loaded_in_place(obj, live_sd, new_sd):
            return  # every value was copied straight into the module's own storage
        obj.load_state_dict(new_sd)


def mismatch(path: str, live: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Refuse a stored tensor the live one cannot take as it is (``copy_`` would broadcast
    or cast: int64 -> int32 wraps, fp32 -> bf16 rounds)."""
    if tuple(live.shape) != tuple(shape):
        raise CheckpointError(
            f"{path}: the checkpoint holds shape {tuple(shape)} but the live tensor is "
            f"{tuple(live.shape)}; build the model with the same configuration before loading"
        )
    if live.dtype != dtype:
        raise CheckpointError(
            f"{path}: the checkpoint holds {dtype} values but the live tensor is {live.dtype}; "
            f"load into a model of the saved dtype (cast it after load() if you want {live.dtype})"
        )


_NORM = torch.nn.modules.batchnorm._NormBase
# torch's loaders whose refusals are the keys' (a _NormBase fills in num_batches_tracked; an
# _InstanceNorm's own rule refuses through the same error list)
_MODULE_LOADS = (torch.nn.Module._load_from_state_dict, _NORM._load_from_state_dict,
                 torch.nn.modules.instancenorm._InstanceNorm._load_from_state_dict)


def _plain_module(m: torch.nn.Module) -> bool:
    """Whether torch's own code, and only that, loads ``m``'s state: only then is what its
    load_state_dict refuses known before it runs (no override, no load hook)."""
    cls = type(m)
    return (cls.load_state_dict is torch.nn.Module.load_state_dict and cls._load_from_state_dict in _MODULE_LOADS
            and not m._load_state_dict_pre_hooks and not m._load_state_dict_post_hooks)


def _plain_optimizer(o: torch.optim.Optimizer) -> bool:
    return (type(o).load_state_dict is torch.optim.Optimizer.load_state_dict
            and not o._optimizer_load_state_dict_pre_hooks and not o._optimizer_load_state_dict_post_hooks)


def _refused_by_load_state_dict(node: dict[str, Any], obj: Any, live_sd: Any, path: str) -> None:
    """Raise what ``obj.load_state_dict`` would raise for the saved state, where torch's own
    rules decide it (a module's keys, an optimizer's parameter groups): else the tensors
    that match are written in place first, and the refusal comes after them."""
    saved = node.get("v")
    if not isinstance(saved, dict) or "d" not in saved:
        return
    if node.get("S") == "module" and isinstance(obj, torch.nn.Module):
        mods = dict(obj.named_modules())
        others = tuple(f"{name}." for name, m in mods.items() if not _plain_module(m))
        if "." in others:  # the module itself loads its own way
            return

        def judged(key: Any) -> bool:  # not under a submodule that loads its own way
            return not str(key).startswith(others)  # () starts nothing

        def filled_in(key: Any) -> bool:  # a BatchNorm takes a state without its batch count
            owner, _, name = str(key).rpartition(".")
            norm = mods.get(owner)
            return name == "num_batches_tracked" and isinstance(norm, _NORM) and norm.track_running_stats

        keys = {k for k, _ in saved["d"]}
        missing = sorted((k for k in set(live_sd) - keys if judged(k) and not filled_in(k)), key=str)
        unexpected = sorted((k for k in keys - set(live_sd) if judged(k)), key=str)
        if missing or unexpected:
            said = "; ".join(f"{what} {names[:6]}{' ...' if len(names) > 6 else ''}" for what, names in
                             (("the live module has keys the checkpoint lacks:", missing),
                              ("the checkpoint has keys the live module lacks:", unexpected)) if names)
            raise CheckpointError(f"{path}: {said}; build the model with the configuration it was saved with "
                                  f"(nothing was loaded)")
    elif node.get("S") == "optimizer" and isinstance(obj, torch.optim.Optimizer):
        if not _plain_optimizer(obj):
            return
        groups = dict((k, v) for k, v in saved["d"]).get("param_groups", {}).get("l")
        if not isinstance(groups, list):
            return
        sizes = [len(dict((k, v) for k, v in g.get("d", [])).get("params", {}).get("l", [])) for g in groups]
        live = [len(g["params"]) for g in obj.param_groups]
        if sizes != live:
            raise CheckpointError(
                f"{path}: the checkpoint's optimizer has parameter groups of {sizes} parameters, the live one "
                f"{live}; build the optimizer with the parameter groups it was saved with (nothing was loaded)")


def _copy_into(live: torch.Tensor, src: torch.Tensor, path: str) -> None:
    """``live.copy_(src)``; an expanded live tensor (stride 0 along a dimension: one value
    in memory for all of it, as ``expand()`` gives) takes the stored values along the
    dimensions it holds, once they are checked to be one value along the others."""
    for d, (size, stride) in enumerate(zip(live.shape, live.stride())):
        if stride == 0 and size > 1:
            first = src.narrow(d, 0, 1)
            if not _same(src, first.expand_as(src)):
                raise CheckpointError(
                    f"{path}: the live tensor is expanded along dimension {d} (one value in memory for all of "
                    f"it) but the checkpoint holds different values along it; load into a tensor of its own "
                    f"(.clone() it before load())")
            live, src = live.narrow(d, 0, 1), first
    live.copy_(src)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN."""
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _like(live: Any, value: Any) -> Any:
    """A saved scalar as the live value's enum class (an ``IntEnum`` phase is stored as its
    int), when it is a member of it; else the value as saved."""
    import enum

    if isinstance(live, enum.Enum) and type(value) is not type(live):
        try:
            return type(live)(value)
        except (ValueError, TypeError):
            return value
    if type(live).__module__ == "numpy" and type(value) in (int, float, bool):  # a numpy scalar: its type again
        import numpy as np

        kind = np.bool_ if type(value) is bool else np.integer if type(value) is int else np.floating
        if isinstance(live, kind):  # only where the value is of its kind and it holds the value exactly
            try:
                again = type(live)(value)
            except (ValueError, TypeError, OverflowError):
                return value
            if again == value or (value != value and again != again):
                return again
    return value


def _saved_kind(node: Any) -> str:
    if isinstance(node, dict) and "S" in node:
        return {"module": "a torch Module's state", "optimizer": "a torch Optimizer's state"}.get(
            str(node["S"]), "an object's state_dict()")
    kinds = {"T": "a tensor", "D": "a DTensor", "v": "a value", "f": "a float", "d": "a dict",
             "l": "a list", "t": "a tuple", "P": "a pickled object"}
    return next((kinds[k] for k in kinds if isinstance(node, dict) and k in node), "a value")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
    )


def _loaded_in_place(module: torch.nn.Module, live_sd: Mapping[str, Any], new_sd: Mapping[str, Any]) -> bool:
    if set(live_sd) != set(new_sd):
        return False  # let load_state_dict report missing/unexpected keys
    own = {t.data_ptr() for t in itertools.chain(module.parameters(), module.buffers())
           if t.layout is torch.strided}  # a sparse buffer (left out of the state dict) has no data pointer
    for k, v in new_sd.items():
        if v is not live_sd[k] or not isinstance(v, torch.Tensor):
            return False
        local = dtensor.local_of(v) if dtensor.is_dtensor(v) else v
        if local.numel() and local.data_ptr() not in own:
            return False
    return True


def init_lazy_optimizers(state: Mapping[str, Any], tree: Any) -> None:
    """Give optimizers that have not stepped yet their state tensors, so load is in place
    (a restore refused before any byte landed empties their state again: ``restore``).

    Runs one step with zero gradients and a learning rate of 0 (parameters unchanged),
    only for optimizers whose live state is empty while the checkpoint has state.
    """
    if not isinstance(tree, dict) or "d" not in tree:
        return
    for key, node in tree["d"]:
        obj = state.get(key) if isinstance(state, Mapping) else None
        if not (isinstance(obj, torch.optim.Optimizer) and isinstance(node, dict) and node.get("S") == "optimizer"):
            continue
        saved = dict((k, v) for k, v in node["v"].get("d", []))
        if obj.state or not saved.get("state", {}).get("d"):
            continue
        init_optimizer_state(obj)


def init_optimizer_state(obj: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state tensors: one step with zero
    gradients and a learning rate of 0 (parameters unchanged). An optimizer that cannot
    step that way (LBFGS needs a closure) is left without state."""
    params = [p for g in obj.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in obj.param_groups]
    try:
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p)
            for g in obj.param_groups:
                if "lr" in g:
                    g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
            obj.step()
    except Exception:  # noqa: BLE001 - e.g. LBFGS needs a closure: fall back to rebuilt tensors
        obj.state.clear()
    finally:
        for g, lr in zip(obj.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g


def _check_tree(state: Mapping[str, Any], tree: Any) -> None:
    if not isinstance(tree, dict) or "d" not in tree:
        raise CheckpointError("checkpoint record has no state tree; it was not written by incluster")
    saved_keys = [k for k, _ in tree["d"]]
    missing = [k for k in state if k not in saved_keys]
    if missing:
        raise CheckpointError(
            f"the checkpoint has no entry for {missing} (it holds {saved_keys}); load with the "
            f"same state keys it was saved with"
        )


def live_targets(state: Mapping[str, Any], tree: Any, *, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The live tensor that :func:`load_into` would copy each stored tensor into (the same
    walk, run dry: nothing is copied, no ``load_state_dict`` is called). Optimizers that
    have not stepped get their state first, as ``load_into`` would give it them.

    A restore may write stored bytes straight into these tensors and then pass them to
    ``load_into`` as ``placed``; names it cannot place this way are fetched as usual."""
    _check_tree(state, tree)
    loader = _Loader(lambda name: torch.empty(0), allow_pickle, collect={})
    _dry_walk(state, tree, loader)
    return loader.collect or {}


def _dry_walk(state: Mapping[str, Any], tree: Any, loader: "_Loader") -> None:
    """Walk ``tree`` over the live state without copying (optimizers get their state first)."""
    with torch.no_grad():
        init_lazy_optimizers(state, tree)
        for key, node in tree["d"]:
            if key in state:
                loader.top(node, state[key], escape_part(key))


def live_dtensors(state: Mapping[str, Any], tree: Any, *, allow_pickle: bool = False) -> dict[str, tuple[Any, str]]:
    """The live DTensor (and its path) each stored DTensor shard of ``tree`` belongs to;
    like :func:`live_targets`, a dry walk. A name whose live value is not a DTensor is
    absent."""
    _check_tree(state, tree)
    loader = _Loader(lambda name: torch.empty(0), allow_pickle, collect={})
    loader.dtensors = {}
    _dry_walk(state, tree, loader)
    return loader.dtensors


def load_into(
    state: Mapping[str, Any],
    tree: Any,
    fetch: Fetch,
    *,
    allow_pickle: bool = False,
    placed: Mapping[str, torch.Tensor] | None = None,
    left_out_ok: bool = False,
) -> None:
    """Restore ``tree`` into the live ``state`` in place; raise naming any mismatch.

    ``placed``: tensors that already hold a stored tensor's bytes (written there by the
    caller, see :func:`live_targets`); a live tensor that is that very memory is not
    copied again, any other use of the name copies from it instead of calling ``fetch``.
    ``left_out_ok``: parts of the checkpoint missing from ``state`` are left out on purpose
    (an integration's evaluation load, without optimizers): said at INFO, not WARNING."""
    _check_tree(state, tree)
    left_out = tuple(k for k, _ in tree["d"] if k not in state)
    if left_out and left_out_ok:
        log.info("incluster: the checkpoint also holds %s, not restored (not needed here)", list(left_out))
    elif left_out and left_out not in _SAID_LEFT_OUT:  # a model-only load is fine; a forgotten optimizer is not
        _SAID_LEFT_OUT.add(left_out)
        log.warning("incluster: the checkpoint also holds %s, which this load() was not given: not restored "
                    "(put it in the state passed to load() to restore it)", list(left_out))
    loader = _Loader(fetch, allow_pickle, placed)
    with torch.no_grad():
        init_lazy_optimizers(state, tree)
        for key, node in tree["d"]:
            if key not in state:
                continue  # parts the caller did not ask for are left alone
            live = state[key]
            restored = loader.top(node, live, escape_part(key))
            if not is_stateful(live) and not isinstance(live, torch.Tensor):
                _assign(state, key, live, restored)


def _assign(state: Any, key: Any, live: Any, restored: Any) -> None:
    """Put a restored container/leaf back, mutating live dicts/lists so references stay valid."""
    if isinstance(live, dict) and isinstance(restored, dict):
        live.clear()
        live.update(restored)
    elif isinstance(live, list) and isinstance(restored, list):
        live[:] = restored
    else:
        state[key] = restored
