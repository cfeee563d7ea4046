"""The training loop, its timing helpers and the copy floors of bench/gpu.py (see its docstring)."""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import log, median, scratch_dir  # noqa: E402 - bench/ is not a package

WAIT_S = 60.0  # the longest wait for saves or uploads before a configuration counts as stuck
ALIGN = 4096


# -- the model and the loop --------------------------------------------------------------


def build(args: argparse.Namespace, tokens: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    bias = getattr(args, "bias", False)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.hidden, args.hidden, bias=bias, device=args.dev)
                                  for _ in range(args.layers)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(tokens, args.hidden, device=args.dev)
    return model, optim, x


def train_step(args: argparse.Namespace, model: Any, optim: Any, x: torch.Tensor,
               pre_step: Callable[[], Any] | None = None, post_zero: Callable[[], Any] | None = None) -> float:
    with torch.autocast(args.dev, dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    if pre_step is not None:
        pre_step()
    optim.step()
    optim.zero_grad(set_to_none=True)
    if post_zero is not None:
        post_zero()
    return loss.item()


def run_steps(args: argparse.Namespace, model: Any, optim: Any, x: torch.Tensor, steps: int,
              save_at: set[int] = frozenset(), save: Callable[[int], Any] | None = None,  # type: ignore[assignment]
              pre_step: Callable[[], Any] | None = None, after: Callable[[int], Any] | None = None,
              times: list[float] | None = None) -> list[float]:
    """``steps`` timed steps; ``save(i)`` right after ``zero_grad`` of the steps in ``save_at``;
    ``after(i)`` once step i's time is taken. Times go into ``times`` (kept if a step fails)."""
    times = [] if times is None else times
    for i in range(steps):
        hook = (lambda i=i: save(i)) if save is not None and i in save_at else None  # type: ignore[misc]
        t0 = time.perf_counter()
        train_step(args, model, optim, x, pre_step, hook)
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(i)
    return times


class ReadyWatch:
    """When the GPU has done the work enqueued before each ``save()`` - the earliest any
    checkpoint of that state can start - in seconds from the call: a thread waits on an
    event recorded right before it. ``durable_s`` minus this is the checkpoint's own path,
    without the wait for the step the host ran ahead of (a compute-bound loop calls
    ``save()`` with most of a step still queued). CPU: ready at once (0)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import queue
        import threading

        self.cuda = args.dev == "cuda"
        self.ready: dict[int, float] = {}
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="bench-ready", daemon=True)
        if self.cuda:
            self._t.start()

    def mark(self, i: int) -> None:
        if not self.cuda:
            self.ready[i] = 0.0
            return
        ev = torch.cuda.Event()
        ev.record()
        self._q.put((i, ev, time.perf_counter()))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            i, ev, t0 = item
            ev.synchronize()  # releases the GIL
            self.ready[i] = time.perf_counter() - t0

    def close(self) -> dict[int, float]:
        if self.cuda:
            self._q.put(None)
            self._t.join(WAIT_S)
        return self.ready


def warm_up(args: argparse.Namespace, model: Any, optim: Any, x: torch.Tensor) -> None:
    for _ in range(args.warmup):
        train_step(args, model, optim, x)


def named_tensors(model: Any, optim: Any) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then each parameter's optimizer state (AdamW's ``step`` lives on the CPU)."""
    out = [(f"model.{n}", p.data) for n, p in model.named_parameters()]
    for n, p in model.named_parameters():
        for k, v in sorted(optim.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out.append((f"optim.{n}.{k}", v))
    return out


def sync(args: argparse.Namespace) -> None:
    if args.dev == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def scramble(model: Any, optim: Any) -> None:
    for _, t in named_tensors(model, optim):
        if t.is_floating_point():
            t.normal_()


def same_bits(ref: list[tuple[str, torch.Tensor]], now: list[tuple[str, torch.Tensor]]) -> tuple[bool, list[str]]:
    bad = [n for (n, a), (m, b) in zip(ref, now) if n != m or a.shape != b.shape or a.dtype != b.dtype
           or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))]
    if len(ref) != len(now):
        bad.append(f"{len(ref)} tensors before, {len(now)} after")
    return not bad, bad[:5]


# -- floors ------------------------------------------------------------------------------


def timed(args: argparse.Namespace, fn: Callable[[], Any], nbytes: int, repeats: int = 3) -> dict[str, Any]:
    fn()  # warm-up
    sync(args)
    samples = []
    for _ in range(repeats):
        sync(args)
        t0 = time.perf_counter()
        fn()
        sync(args)
        samples.append(time.perf_counter() - t0)
    s = median(samples) or 0.0
    return {"s": s, "samples": samples, "gbps": nbytes / s / 1e9 if s else None}


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


def cuda_check(err: Any, what: str) -> None:
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


def shm_floor(args: argparse.Namespace, ts: list[torch.Tensor], nbytes: int) -> dict[str, Any]:
    """Floor (b): D2H into a file mapping in /dev/shm, page-locked with cudaHostRegister."""
    offs, size = [], 0
    for t in ts:
        offs.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    out: dict[str, Any] = {}
    with scratch_dir("bench-gpu-floor-") as root:
        path = os.path.join(root, "slot")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            t0 = time.perf_counter()
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            out["map_s"] = time.perf_counter() - t0
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            views = [buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offs, ts)]
            registered = False
            try:
                if args.dev == "cuda":
                    t0 = time.perf_counter()
                    cuda_check(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0), "cudaHostRegister")
                    registered = True
                    out["register_s"] = time.perf_counter() - t0
                out.update(timed(args, lambda: copy_all(views, ts), nbytes))
            finally:
                if registered:
                    t0 = time.perf_counter()
                    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                    out["unregister_s"] = time.perf_counter() - t0
                views.clear()
                del buf
                gc.collect()
                mm.close()  # no tensor views it any more
        finally:
            os.close(fd)
    return out


def pinned_floors(args: argparse.Namespace, ts: list[torch.Tensor], nbytes: int, out: dict[str, Any]) -> None:
    """Floors (a) and (c); on the CPU, plain buffers stand in for the pinned ones."""
    cuda = args.dev == "cuda"
    t0 = time.perf_counter()
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in ts]
    out["pinned_alloc_s"] = time.perf_counter() - t0
    try:
        out["d2h_pinned"] = timed(args, lambda: copy_all(bufs, ts), nbytes)
        out["h2d_pinned"] = timed(args, lambda: copy_all(ts, bufs), nbytes)  # the same values back
    finally:
        bufs.clear()
        gc.collect()
        if cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # give the pinned pages back


def d2d_floor(args: argparse.Namespace, ts: list[torch.Tensor], nbytes: int) -> dict[str, Any]:
    dst = [torch.empty_like(t) for t in ts]
    try:
        return timed(args, lambda: copy_all(dst, ts), nbytes)
    finally:
        dst.clear()


def run_floors(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    model, optim, x = build(args, args.tokens_copy)
    warm_up(args, model, optim, x)
    named = named_tensors(model, optim)
    ts = [t for _, t in named if t.device.type == args.dev]
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    report["state"].update(tensors=len(named), device_tensors=len(ts), bytes=nbytes)
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(ts)}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("d2h_pinned", lambda: pinned_floors(args, ts, nbytes, out)),
        ("d2h_registered_shm", lambda: out.__setitem__("d2h_registered_shm", shm_floor(args, ts, nbytes))),
        ("d2d", lambda: out.__setitem__("d2d", d2d_floor(args, ts, nbytes))),
    ]
    for key, fn in steps:
        log(f"  floor {key} ...")
        try:
            with torch.no_grad():
                fn()
        except Exception as exc:  # noqa: BLE001 - one floor failing leaves the others
            out[key] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            log(f"  FAILED: {exc}")
        v = out.get(key) or {}
        log(f"    {(v.get('s') or 0) * 1e3:.1f} ms, {v.get('gbps') or 0:.1f} GB/s")
    return out
