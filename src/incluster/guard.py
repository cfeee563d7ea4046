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
  per save and reports the rest, which the Checkpointer names once in a warning.

IMPORTANT: the hook runs on the thread that calls ``optimizer.step()``; it may block it
(bounded by ``slot_timeout_s``) but never takes a lock the staging thread holds.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

CLONE_LIMIT = 256 * 2**20  # bytes of unguarded tensors cloned per save; beyond, warned


class StepGuard:
    """Registers ``on_step`` as a global optimizer step pre-hook until :meth:`close`."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self._on_step = on_step
        self._seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._cache: "weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], frozenset[int]]]" = (
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

    def pointers(self, found: Iterable[torch.optim.Optimizer]) -> set[int]:
        """Data pointers that only an optimizer step changes: parameters and state of the
        optimizers found in the state and of every optimizer seen stepping."""
        out: set[int] = set()
        for opt in {id(o): o for o in [*found, *self._seen]}.values():
            key = (len(opt.state), sum(len(g["params"]) for g in opt.param_groups))
            hit = self._cache.get(opt)
            if hit is None or hit[0] != key:  # state appears lazily, at the first step
                hit = (key, frozenset(optimizer_pointers(opt)))
                self._cache[opt] = hit
            out |= hit[1]
        return out

    def close(self) -> None:
        self._handle.remove()
        self._cache.clear()


def optimizer_pointers(opt: torch.optim.Optimizer) -> set[int]:
    out = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
    for s in opt.state.values():
        out.update(t.data_ptr() for t in s.values() if isinstance(t, torch.Tensor))
    out.discard(0)
    return out
