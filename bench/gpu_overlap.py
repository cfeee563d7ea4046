"""What does draining a GPU state to host memory cost the training steps it overlaps?

A diagnostic for the device-side snapshot's drain (``bench/gpu.py`` found the step right
after a save ~85 ms slower in a loop of 17 ms steps). One process, one CUDA device, the
state of ``bench/gpu.py`` (6 x Linear(8192, 8192) fp32 + AdamW, 4.5 GiB) and its
copy-bound loop (2048 tokens, ``loss.item()`` each step). At a step boundary a background
thread drains a device copy of the state into a page-locked /dev/shm mapping in one of
these ways, and the steps that overlap it are timed against the same steps without:

  whole      one copy per tensor (256 MiB each), all enqueued at once
  pieces     16 MiB copies, all enqueued at once
  paced      16 MiB copies, at most two in flight (the host waits for the older one)
  kernel     a copy *kernel* writing over PCIe into the mapped host memory (the page-
             locked mapping is addressable from the device), no copy engine involved
  whole/nosync  "whole", but the loop syncs with a stream sync instead of loss.item()
  whole/main "whole" enqueued from the training thread itself (no background thread
             waiting on the GPU): tells copy-engine contention from thread effects
  */low      the same on a side stream of default (lowest) priority instead of the highest
  whole/pinned-item  "whole", the loop reads its loss into page-locked memory (non-blocking
             copy, then a stream sync) instead of loss.item() (pageable)
  ipc        16 MiB copies, two in flight, enqueued by *another process* on the same GPU
             (the buffer shared over CUDA IPC) into its own page-locked memory

Each variant: drain seconds and GB/s, the mean of the steps it overlapped minus the
baseline mean, and the worst step. JSON to --out.

    PYTHONPATH=src python bench/gpu_overlap.py --out overlap.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch

PIECE = 16 << 20


class _HostAsDevice:
    """A page-locked host range seen as a CUDA array (UVA: device address = host address)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def build(hidden: int, layers: int, tokens: int) -> tuple[Any, Any, torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]).cuda()
    o = torch.optim.AdamW(m.parameters(), lr=1e-4)
    return m, o, torch.randn(tokens, hidden, device="cuda")


_PINNED: dict[str, torch.Tensor] = {}


def step(m: Any, o: Any, x: torch.Tensor, item: bool | str) -> float:
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(x).float().pow(2).mean()
    loss.backward()
    o.step()
    o.zero_grad(set_to_none=True)
    if item == "pinned":
        dst = _PINNED.setdefault("loss", torch.empty((), pin_memory=True))
        dst.copy_(loss.detach(), non_blocking=True)
        torch.cuda.current_stream().synchronize()
    elif item:
        loss.item()
    else:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


def _ipc_child(inbox: Any, outbox: Any) -> None:
    """Drains the shared device buffer into this process's page-locked memory on command."""
    torch.cuda.set_device(0)
    g = inbox.get()
    n = g.numel()
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    outbox.put("ready")
    while inbox.get() is not None:
        t0 = time.perf_counter()
        flight: list[Any] = []
        with torch.cuda.stream(side):
            for a in range(0, n, PIECE):
                host[a : min(n, a + PIECE)].copy_(g[a : min(n, a + PIECE)], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
                flight.append(ev)
                while len(flight) > 2:
                    flight.pop(0).synchronize()
        side.synchronize()
        outbox.put((time.perf_counter() - t0, bool(torch.equal(host[: 1 << 20].cuda(), g[: 1 << 20]))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-overlap.json")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="steps timed per variant")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: nothing to measure")
        return 0
    m, o, x = build(args.hidden, args.layers, args.tokens)
    for _ in range(3):
        step(m, o, x, True)
    ts = [p for p in m.parameters()] + [v for s in o.state.values() for v in s.values() if v.is_cuda]
    n = sum(t.nbytes for t in ts)
    gbuf = torch.empty(n, dtype=torch.uint8, device="cuda")
    views, at = [], 0
    for t in ts:
        views.append((at, t.nbytes))
        gbuf[at : at + t.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
        at += t.nbytes
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="bench-overlap-")
    out: dict[str, Any] = {"bytes": n, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        os.posix_fallocate(fd, 0, n)
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        host = torch.frombuffer(mm, dtype=torch.uint8)
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(host.data_ptr(), n, 0)
        out["register"] = int(getattr(err, "value", err))
        high, low = torch.cuda.Stream(priority=-100), torch.cuda.Stream(priority=0)
        side = high

        def whole(stream: Any = high) -> None:
            with torch.cuda.stream(stream):
                for a, k in views:
                    host[a : a + k].copy_(gbuf[a : a + k], non_blocking=True)
            stream.synchronize()

        def pieces(window: int | None, stream: Any = high) -> Callable[[], None]:
            def run() -> None:
                flight: list[Any] = []
                with torch.cuda.stream(stream):
                    for a in range(0, n, PIECE):
                        host[a : min(n, a + PIECE)].copy_(gbuf[a : min(n, a + PIECE)], non_blocking=True)
                        if window is not None:
                            ev = torch.cuda.Event()
                            ev.record(stream)
                            flight.append(ev)
                            while len(flight) > window:
                                flight.pop(0).synchronize()
                stream.synchronize()
            return run

        def kernel() -> None:
            dev = torch.as_tensor(_HostAsDevice(host.data_ptr(), n), device="cuda")
            with torch.cuda.stream(side):
                d64, s64 = dev[: n - n % 8].view(torch.int64), gbuf[: n - n % 8].view(torch.int64)
                torch.bitwise_or(s64, 0, out=d64)
            side.synchronize()

        ipc: dict[str, Any] = {}

        def via_ipc() -> None:
            if not ipc:
                ctx = torch.multiprocessing.get_context("spawn")
                ipc["in"], ipc["out"] = ctx.Queue(), ctx.Queue()
                ipc["proc"] = ctx.Process(target=_ipc_child, args=(ipc["in"], ipc["out"]), daemon=True)
                ipc["proc"].start()
                ipc["in"].put(gbuf)
                assert ipc["out"].get(timeout=120) == "ready"
            ipc["in"].put("go")
            ipc["last"] = ipc["out"].get(timeout=60)

        variants: list[tuple[str, Callable[[], None], bool | str]] = [
            ("whole", whole, True), ("pieces", pieces(None), True), ("paced", pieces(2), True),
            ("kernel", kernel, True), ("whole/nosync", whole, False), ("whole/main", whole, True),
            ("whole/low", lambda: whole(low), True), ("paced/low", pieces(2, low), True),
            ("whole/pinned-item", whole, "pinned"), ("ipc", via_ipc, True),
        ]
        only = [v for v in args.only.split(",") if v]
        variants = [v for v in variants if not only or v[0] in only]
        if any(v[0] == "ipc" for v in variants):
            via_ipc()  # start the other process and warm it before anything is timed
        base = {k: [step(m, o, x, k) for _ in range(args.steps)] for k in (True, False, "pinned")}
        out["baseline_ms"] = {str(k): 1e3 * sum(v) / len(v) for k, v in base.items()}
        print(f"state {n / 2**30:.2f} GiB; baseline step {out['baseline_ms']['True']:.1f} ms "
              f"(loss.item()), {out['baseline_ms']['False']:.1f} ms (stream sync)", flush=True)
        for name, fn, item in variants:
            try:
                res: dict[str, Any] = {}
                steps = []
                if name == "whole/main":  # enqueued here; the loop runs until the copies are done
                    t0 = time.perf_counter()
                    with torch.cuda.stream(side):
                        for a, k in views:
                            host[a : a + k].copy_(gbuf[a : a + k], non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(side)
                    while not done.query() or len(steps) < 2:
                        steps.append(step(m, o, x, item))
                        if "drain_s" not in res and done.query():
                            res["drain_s"] = time.perf_counter() - t0
                        if len(steps) >= 40:
                            break
                    done.synchronize()
                    res.setdefault("drain_s", time.perf_counter() - t0)
                else:
                    def drain() -> None:
                        t0 = time.perf_counter()
                        fn()
                        res["drain_s"] = time.perf_counter() - t0

                    th = threading.Thread(target=drain)
                    th.start()
                    while th.is_alive() or len(steps) < 2:
                        steps.append(step(m, o, x, item))
                        if len(steps) >= 40:
                            break
                    th.join()
                ok = ipc["last"][1] if name == "ipc" else bool(torch.equal(host[: 1 << 20].cuda(), gbuf[: 1 << 20]))
                b = sum(base[item]) / len(base[item])
                res.update(steps_ms=[1e3 * s for s in steps], gbps=n / res["drain_s"] / 1e9, bytes_ok=ok,
                           overlap_extra_ms=1e3 * (sum(steps) - b * len(steps)), worst_ms=1e3 * max(steps))
                out[name] = res
                print(f"{name:13s} drain {1e3 * res['drain_s']:7.1f} ms ({res['gbps']:5.1f} GB/s), steps "
                      f"{len(steps)}, extra {res['overlap_extra_ms']:6.1f} ms, worst {res['worst_ms']:6.1f} ms, "
                      f"ok {ok}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a diagnostic: record and go on
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{name}: ERROR {type(exc).__name__}: {exc}", flush=True)
        if ipc:
            ipc["in"].put(None)
            ipc["proc"].join(timeout=30)
        rt.cudaHostUnregister(host.data_ptr())
        del host
        try:
            mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process
    finally:
        os.close(fd)
        os.unlink(path)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
