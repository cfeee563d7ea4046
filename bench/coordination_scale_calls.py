"""``bench/coordination_scale.py``'s call counters: wrap, in a rank's process, the job store
client and the torch.distributed collectives, and record each call's count, bytes and time."""

from __future__ import annotations

import threading
import time
from typing import Any


class Calls:
    """Coordination calls made by this process, grouped by save (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.store_ops: list[tuple[str, str, float]] = []  # (op, key, seconds)
            self.object_colls: list[tuple[str, float]] = []  # (name, seconds)
            self.tensor_colls: list[str] = []
            self.pickled = 0

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            ops = [o for o in self.store_ops if o[1].startswith("incluster/")]
            return {
                "store_ops": len(ops),
                "store_op_kinds": sorted({o[0] for o in ops}),
                "store_op_list": [f"{o[0]} {o[1]}" for o in ops],
                "store_op_s": sum(o[2] for o in ops if o[0] != "wait"),
                "store_wait_s": sum(o[2] for o in ops if o[0] == "wait"),
                "object_colls": len(self.object_colls),
                "object_coll_s": sum(o[1] for o in self.object_colls),
                "tensor_colls": len(self.tensor_colls),
                "pickled_bytes": self.pickled,
            }


CALLS = Calls()


def instrument_torch() -> None:
    """Wrap, in this process, the calls DCP and the incluster store client make."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    # Object collectives, as _DistWrapper (torch/distributed/checkpoint/utils.py) calls
    # them: ``dist.gather_object(...)`` looks the name up on torch.distributed each time.
    def wrap_object(name: str) -> None:
        orig = getattr(dist, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                with CALLS.lock:
                    CALLS.object_colls.append((name, time.perf_counter() - t0))

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        setattr(dist, name, wrapper)

    for name in ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object", "barrier"):
        wrap_object(name)

    # The tensor collectives under them and the pickling, looked up as globals of c10d.
    def wrap_tensor(name: str) -> None:
        orig = getattr(c10d, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with CALLS.lock:
                CALLS.tensor_colls.append(name)
            return orig(*args, **kwargs)

        setattr(c10d, name, wrapper)

    for name in ("all_gather", "gather", "scatter", "broadcast"):
        wrap_tensor(name)

    orig_o2t = c10d._object_to_tensor

    def o2t(obj: Any, device: Any, group: Any) -> Any:
        tensor, size = orig_o2t(obj, device, group)
        with CALLS.lock:
            CALLS.pickled += int(size.item() if hasattr(size, "item") else size)
        return tensor, size

    c10d._object_to_tensor = o2t

    # The job store client: StoreCoordinator does ``from torch.distributed import TCPStore``
    # when it is created, so a subclass put there sees every operation it makes.
    base = dist.TCPStore

    class CountingTCPStore(base):  # type: ignore[misc, valid-type]
        def _rec(self, op: str, key: Any, t0: float) -> None:
            k = key[0] if isinstance(key, (list, tuple)) and key else key
            with CALLS.lock:
                CALLS.store_ops.append((op, str(k), time.perf_counter() - t0))

        def add(self, key: str, value: int) -> int:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().add(key, value)
            self._rec("add", key, t0)
            return r

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().compare_set(key, expected, desired)
            self._rec("compare_set", key, t0)
            return r

        def get(self, key: str) -> bytes:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().get(key)
            self._rec("get", key, t0)
            return r

        def set(self, key: str, value: Any) -> None:  # type: ignore[override]
            t0 = time.perf_counter()
            super().set(key, value)
            self._rec("set", key, t0)

        def check(self, keys: list[str]) -> bool:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().check(keys)
            self._rec("check", keys, t0)
            return r

        def wait(self, keys: list[str], *timeout: Any) -> None:  # type: ignore[override]
            t0 = time.perf_counter()
            super().wait(keys, *timeout)
            self._rec("wait", keys, t0)

    dist.TCPStore = CountingTCPStore  # type: ignore[misc]
