"""After a peer restore: which live tensors the deferred heal must copy first, and which
optimizers must wait for it.

A received shard is verified and in the live tensors when ``load()`` returns; writing it
into the node's RAM disk (the heal) runs in the background, like a save's copy, and the
optimizer pre-step hook keeps parameters and optimizer state unchanged until it is done.
Tensors the hook does not guard (module buffers such as BatchNorm statistics, plain
tensors in the state) can change in the next forward pass, so their verified bytes are
copied aside before ``load()`` returns.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from incluster.guard import optimizer_pointers
from incluster.state_load import live_targets


def _walk(obj: Any) -> Iterator[Any]:
    yield obj
    if isinstance(obj, Mapping):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def _guarded(state: Mapping[str, Any]) -> set[int]:
    """Data pointers that only ``optimizer.step()`` changes: parameters and optimizer state."""
    out: set[int] = set()
    for obj in _walk(state):
        if isinstance(obj, torch.nn.Parameter):
            out.add(obj.data_ptr())
        elif isinstance(obj, torch.nn.Module):
            out.update(p.data_ptr() for p in obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            out |= optimizer_pointers(obj)
    return out


def changing_pointers(state: Mapping[str, Any], tree: Any, *, allow_pickle: bool) -> set[int]:
    """Data pointers of live tensors the restore wrote that may change before the heal."""
    guarded = _guarded(state)
    live = live_targets(state, tree, allow_pickle=allow_pickle)
    return {t.data_ptr() for t in live.values() if t.data_ptr() not in guarded}
