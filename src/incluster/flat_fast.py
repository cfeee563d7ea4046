"""The staging thread's flatten for a structure it has flattened before.

:func:`incluster.state.flatten_snapshot` builds every tensor's name from its path, checks
every key and value, makes a spec per tensor and describes every DTensor's placement:
~5 us a tensor in Python, 12 ms for 2,300 tensors on the 2-core machine, all of it on
the staging thread before the first GPU copy of a save is enqueued (and holding the GIL
the training loop launches its kernels with). A job saves one or two structures over and
over, so :class:`FastFlattener` walks the snapshot once without names or checks, records
its *signature* (every container's keys or length, every leaf's kind, every tensor's
dtype, shape, device and which earlier tensor it is tied to) and, for a signature it has
seen, takes the names, specs and byte count from that earlier flatten; the values (the
tree's numbers, the tensors) are always this save's own.

A signature is trusted only once :func:`flatten_snapshot` flattened a snapshot with that
exact signature and the result matched the walk's tensor for tensor and node for node, so
every check the slow walk makes holds for it too. Anything the walk does not know (an
enum key, a numpy scalar, an object to pickle, a Mapping that is not a dict) goes the slow
way, with its precise error; after a few of those in a row the fast walk is skipped.

WARNING: one instance per staging thread; not thread-safe.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from incluster import dtensor
from incluster.format.layout import TensorSpec
from incluster.state import Flat, _Captured, _float_node, _Root, flatten_snapshot, view_key

log = logging.getLogger("incluster")
_T, _P = torch.Tensor, torch.nn.Parameter
_CAPACITY = 4  # structures remembered (a job has one or two)
_GIVE_UP = 3  # slow-only snapshots in a row before the fast walk stops trying


class _Unknown(Exception):
    """A value the fast walk does not handle: flatten this snapshot the slow way."""


class _Walk:
    """One snapshot walked without names: the tree with tensor nodes to be named, the
    tensors in the slow walk's order (tied views once), and the signature."""

    __slots__ = ("sig", "tensors", "walked", "fill", "by_ptr", "buffers", "clone_ptrs", "describe")

    def __init__(self, clones: dict[Any, torch.Tensor], describe: Any) -> None:
        self.sig: list[Any] = []
        self.tensors: list[torch.Tensor] = []  # what is stored: a save-time clone in place of its view
        self.walked: list[torch.Tensor] = []  # the same tensors as the walk found them
        self.fill: list[tuple[dict[str, Any], str, int]] = []  # (node, its key, tensor index)
        self.by_ptr: dict[int, list[int]] = {}  # data pointer -> the tensors stored from it
        self.buffers = dict(clones)
        self.clone_ptrs = {k[0] for k in clones}
        self.describe = describe

    def tensor(self, t: torch.Tensor, node: dict[str, Any], tag: str) -> dict[str, Any]:
        ptr = t.data_ptr()  # raises for a sparse tensor: the slow walk names it
        if t.layout is not torch.strided:
            raise _Unknown
        dtype, shape = t.dtype, t.shape  # a strided nested tensor has no shape: raises
        stored = t
        if ptr:
            prior = self._tied(t, ptr)
            if prior is not None:  # the same view of the same storage: stored once
                self.sig.append(prior)
                self.fill.append((node, tag, prior))
                return node
            if ptr in self.clone_ptrs:
                stored = self.buffers.get(view_key(t), t)  # the value this view had when save() was called
            self.sig.append((dtype, shape))
        else:  # empty, or on the meta device (which the slow walk refuses: never learned)
            self.sig.append((dtype, shape, t.device))
        self.fill.append((node, tag, len(self.tensors)))
        self.walked.append(t)
        self.tensors.append(stored)
        return node

    def _tied(self, t: torch.Tensor, ptr: int) -> int | None:
        """The stored tensor ``t`` is a view of, as the slow walk's whole view key
        (pointer, dtype, shape, strides, device) says; the key is made only for a
        pointer met twice (tied weights), not for every tensor."""
        at = self.by_ptr.get(ptr)
        if at is None:
            self.by_ptr[ptr] = [len(self.tensors)]
            return None
        key = view_key(t)
        for i in at:
            if view_key(self.walked[i]) == key:
                return i
        at.append(len(self.tensors))
        return None

    def walk(self, obj: Any) -> Any:
        cls = type(obj)
        sig = self.sig
        if cls is _T or cls is _P:
            return self.tensor(obj, {"T": None}, "T")
        if cls is str or cls is int or cls is bool or obj is None:
            sig.append("v")
            return {"v": obj}
        if cls is float:
            sig.append("f")
            return _float_node(obj)
        if isinstance(obj, dict):
            sig.append(("d", tuple(obj)))  # a kind first in every tuple: no two kinds of node read alike
            items = []
            for k, v in obj.items():
                if type(k) is not str and type(k) is not int:
                    raise _Unknown
                vc = type(v)
                if vc is _T or vc is _P:  # the common leaf inline
                    items.append([k, self.tensor(v, {"T": None}, "T")])
                else:
                    items.append([k, self.walk(v)])
            return {"d": items}
        if isinstance(obj, (list, tuple)):
            tag = "t" if isinstance(obj, tuple) else "l"
            sig.append((tag, len(obj)))
            return {tag: [self.walk(v) for v in obj]}
        if cls is _Captured:
            if obj.buffers:
                self.buffers.update(obj.buffers)
                self.clone_ptrs.update(k[0] for k in obj.buffers)
            sig.append(("S", obj.kind))
            return {"S": obj.kind, "v": self.walk(obj.sd)}
        if cls is dtensor.Pinned or dtensor.is_dtensor(obj):
            local = dtensor.local_of(obj)
            if type(local) is not _T:
                raise _Unknown
            node: dict[str, Any] = {"D": None}
            node.update(self.describe(obj, local))
            sig.append("D")
            return self.tensor(local, node, "D")
        raise _Unknown


def _copy_describe(d: dict[str, Any]) -> dict[str, Any]:
    """A placement description of its own for each tree (the cached one is never shared)."""
    return {k: [list(p) for p in v] if k == "placements" else list(v) for k, v in d.items()}


class FastFlattener:
    """:func:`flatten_snapshot` with a memory of the structures it flattened (see the module
    docstring). ``hits``/``misses``/``slow`` count what each call did."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self._known: dict[tuple[Any, ...], tuple[list[TensorSpec], list[str], int]] = {}
        self._placements: dict[int, tuple[Any, ...]] = {}
        self._unknown_in_a_row = 0
        self.hits = self.misses = self.slow = 0

    def flatten(self, snap: Any) -> Flat:
        if self._unknown_in_a_row >= _GIVE_UP:
            self.slow += 1
            return flatten_snapshot(snap, allow_pickle=self.allow_pickle)
        clones, tree = (snap.clones, snap.tree) if isinstance(snap, _Root) else ({}, snap)
        w = _Walk(clones, self._describe)
        try:
            with torch.no_grad():
                out = w.walk(tree)
        except Exception:  # noqa: BLE001 - _Unknown, or anything odd: the slow walk says what is wrong
            self._unknown_in_a_row += 1
            self.slow += 1
            return flatten_snapshot(snap, allow_pickle=self.allow_pickle)
        sig = tuple(w.sig)
        known = self._known.get(sig)
        if known is not None:
            self.hits += 1
            self._unknown_in_a_row = 0
            specs, names, nbytes = known
            for node, tag, i in w.fill:
                node[tag] = names[i]
            return Flat(tensors=w.tensors, specs=list(specs), tree=out, nbytes=nbytes)
        self.misses += 1
        flat = flatten_snapshot(snap, allow_pickle=self.allow_pickle)  # raises what save() must hear
        self._learn(sig, w, out, flat)
        return flat

    def _learn(self, sig: tuple[Any, ...], w: _Walk, out: Any, flat: Flat) -> None:
        """Trust ``sig`` only where the walk found what the slow flatten did."""
        names = [s.name for s in flat.specs]
        same = (len(flat.tensors) == len(w.tensors) and all(a is b for a, b in zip(flat.tensors, w.tensors))
                and not flat.optimizers)
        if same:
            for node, tag, i in w.fill:
                node[tag] = names[i]
            same = out == flat.tree
        if not same:
            self._unknown_in_a_row += 1
            log.debug("incluster: the fast flatten's walk differs from the full one; this structure goes the slow way")
            return
        self._unknown_in_a_row = 0
        if len(self._known) >= _CAPACITY:
            self._known.pop(next(iter(self._known)))
        self._known[sig] = (list(flat.specs), names, flat.nbytes)

    def _describe(self, dt: Any, local: torch.Tensor) -> dict[str, Any]:
        """``dtensor.describe``, once per placement spec object (FSDP2 keeps a parameter's
        spec, and so its optimizer state's, from step to step)."""
        spec = dt._spec
        now = (spec, spec.mesh, spec.placements, spec.tensor_meta, local.shape)
        cached = self._placements.get(id(spec))
        if cached is not None and all(a is b for a, b in zip(cached[:4], now)) and cached[4] == now[4]:
            return _copy_describe(cached[5])
        d = dtensor.describe(dt)
        if len(self._placements) > 1 << 16:
            self._placements.clear()
        self._placements[id(spec)] = (*now, d)
        return _copy_describe(d)
