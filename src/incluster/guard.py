"""What keeps a save's tensors unchanged until they are copied out.

Two mechanisms, whatever container the state comes in (an Optimizer object, the plain
dicts of ``get_state_dict``, a Stateful app-state object):

- **Every optimizer step waits.** :class:`StepGuard` registers torch's *global* optimizer
  step pre-hook, so any ``optimizer.step()`` in the process - also of an optimizer the
  state only holds as a ``state_dict()`` - first waits for the save in flight (on the GPU
  the compute stream waits; the host does not). It also remembers every optimizer it saw
  step, which tells which tensors only a step can change. A ``step(closure)`` of a torch
  optimizer (Lightning, LBFGS) waits at the end of the closure instead: after the forward
  and backward pass it runs, before any update.
- **Everything else is copied at save() time.** A tensor that is neither a parameter nor
  optimizer state of a known optimizer (module buffers such as BatchNorm statistics,
  plain tensors) can change in the next forward pass; ``state.snapshot`` clones those
  (asynchronously, on the compute stream, for GPU tensors) up to ``CLONE_LIMIT`` bytes
  per save and reports the rest, which the Checkpointer names once in a warning. Large
  CPU clones go into memory reused from save to save (:class:`ClonePool`).

IMPORTANT: the hook runs on the thread that calls ``optimizer.step()``; it may block it
(bounded by ``slot_timeout_s``) but never takes a lock the staging thread holds.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, Iterable

import torch

CLONE_LIMIT = 256 * 2**20  # bytes of unguarded tensors cloned per save; beyond, warned
POOL_MIN = 1 << 20  # CPU clones from this size on reuse pooled memory (smaller: malloc reuses its own)


class StepGuard:
    """Registers ``on_step`` as a global optimizer step pre-hook until :meth:`close`."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self._on_step = on_step
        self._seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._cache: "weakref.WeakKeyDictionary[Any, tuple[tuple[int, int, int, int], frozenset[int]]]" = (
            weakref.WeakKeyDictionary()
        )
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handle: Any = register_optimizer_step_pre_hook(self._hook)

    def _hook(self, opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._seen.add(opt)
        # torch passes step()'s own arguments, the optimizer first: (self, closure?).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None or not callable(closure) or not type(opt).__module__.startswith("torch.optim"):
            self._on_step()
            return None
        # step(closure): torch's optimizers run the closure (forward and backward) before
        # they change anything, so the wait moves to its end and overlaps the forward and
        # backward pass, as it does for a loop that calls step() after backward().
        on_step = self._on_step

        def closure_then_wait(*a: Any, **k: Any) -> Any:
            try:
                return closure(*a, **k)
            finally:
                on_step()

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs

    def stepped(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` has stepped since this guard was registered."""
        return opt in self._seen

    def pointers(self, found: Iterable[torch.optim.Optimizer]) -> set[int]:
        """Data pointers that only an optimizer step changes: parameters and state of the
        optimizers found in the state and of every optimizer seen stepping."""
        out: set[int] = set()
        for opt in {id(o): o for o in [*found, *self._seen]}.values():
            # Cached while the optimizer holds the same tensors: its state appears lazily
            # (at the first step), load_state_dict() puts new state tensors in a new dict,
            # a parameter's .data can be replaced (model.to(), p.data = ...), and state
            # tensors can be swapped in place (an offload: st[k] = v.to(...)). A stale entry
            # would take memory the optimizer let go of - reused for a plain tensor - as
            # guarded: not copied at save(), so changed under the copy. Every parameter's
            # pointer is in the key; of the state, the first and last entry's tensors
            # (all of them: ~1.4 ms per save for 2000 parameters, on the training thread).
            params = [p for g in opt.param_groups for p in g["params"]]
            key = (id(opt.state), len(opt.state), hash(tuple(map(torch.Tensor.data_ptr, params))),
                   _sampled_state(opt))
            hit = self._cache.get(opt)
            if hit is None or hit[0] != key:
                hit = (key, frozenset(optimizer_pointers(opt)))
                self._cache[opt] = hit
            out |= hit[1]
        return out

    def close(self) -> None:
        self._handle.remove()
        self._cache.clear()


def _sampled_state(opt: torch.optim.Optimizer) -> int:
    """A hash of the pointers of the first and last state entry's tensors (entries, not
    parameters: a frozen first or last parameter has no state)."""
    if not opt.state:
        return 0
    ptrs: list[int] = []
    for s in (next(iter(opt.state.values())), opt.state[next(reversed(opt.state))]):
        ptrs += [t.data_ptr() for t in s.values() if isinstance(t, torch.Tensor)]
    return hash(tuple(ptrs))


def optimizer_pointers(opt: torch.optim.Optimizer) -> set[int]:
    out = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
    for s in opt.state.values():
        out.update(t.data_ptr() for t in s.values() if isinstance(t, torch.Tensor))
    out.discard(0)
    return out


class ClonePool:
    """Reused host memory for save()'s copies of unguarded CPU tensors.

    A fresh clone per save is an allocation the size of the tensor and, for a large one,
    first-touch page faults - on the training thread, inside save(). Here a 256 MiB
    tensor took 0.16-0.24 s to clone fresh (1.1 s the first time) against 0.03-0.04 s
    copied into reused memory. So each CPU tensor of ``POOL_MIN`` bytes or more is copied
    into a buffer of its dtype and shape that is lent to one save and given back once that
    save is staged (every byte is in the slot: nothing reads the buffer again); a buffer
    given back before the next save is lent to it. :meth:`warm` makes them ahead, in the
    background (``Checkpointer.prepare``). At most ``keep_bytes`` are kept between saves
    (two saves' worth by default); buffers of shapes the latest saves did not use go
    first. GPU tensors are cloned as before: torch's caching allocator already reuses
    their memory, and their copies are ordered on the compute stream.

    Thread-safe: lent on the training thread, given back on the staging thread.
    """

    def __init__(self, keep_bytes: int = 2 * CLONE_LIMIT) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def clone(self, t: torch.Tensor, lent: list[torch.Tensor]) -> torch.Tensor:
        """A copy of ``t`` (same dtype, shape and values; contiguous); a pooled buffer is
        appended to ``lent``, to be given back once the save that holds it is staged."""
        if t.device.type != "cpu" or t.nbytes < POOL_MIN:
            return t.detach().clone()
        key = (t.dtype, tuple(t.shape))
        with self._lock:
            stack = self._free.get(key)
            buf = stack.pop() if stack else None
            if buf is not None:
                self._free_bytes -= buf.nbytes
                if not stack:
                    del self._free[key]
        if buf is None:
            buf = torch.empty(key[1], dtype=t.dtype)
        lent.append(buf)
        buf.copy_(t.detach())
        return buf

    def give_back(self, bufs: list[torch.Tensor]) -> None:
        """``bufs`` are read no more: keep them for the next saves, within ``keep_bytes``."""
        if not bufs:
            return
        with self._lock:
            fresh = set()
            for b in bufs:
                key = (b.dtype, tuple(b.shape))
                fresh.add(key)
                self._free.setdefault(key, []).append(b)
                self._free_bytes += b.nbytes
            for key in [k for k in self._free if k not in fresh] + list(fresh):
                if self._free_bytes <= self.keep_bytes:
                    break
                stack = self._free[key]
                while stack and self._free_bytes > self.keep_bytes:
                    self._free_bytes -= stack.pop().nbytes
                if not stack:
                    del self._free[key]
            bufs.clear()

    def warm(self, shapes: Iterable[tuple[torch.dtype, tuple[int, ...]]]) -> int:
        """Make (and touch) a buffer for each ``(dtype, shape)`` not already free, so the
        next save's clones find them: background threads only. Returns bytes made."""
        want: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}
        for dtype, shape in shapes:
            want[(dtype, tuple(shape))] = want.get((dtype, tuple(shape)), 0) + 1
        made: list[torch.Tensor] = []
        budget = self.keep_bytes
        for key, count in want.items():
            with self._lock:
                have = len(self._free.get(key, ()))
            nbytes = math.prod(key[1]) * key[0].itemsize
            for _ in range(count - have):
                if nbytes < POOL_MIN or nbytes > budget:
                    break
                budget -= nbytes
                made.append(torch.zeros(key[1], dtype=key[0]))  # first-touch page faults here, not in save()
        total = sum(b.nbytes for b in made)
        self.give_back(made)
        return total
