"""Which bounce-buffer shape makes a restore into GPU tensors fastest? The real read path
(``incluster.recovery.landing.read_verified``: pread -> hash -> non-blocking H2D through
page-locked bounce buffers) timed over one shard-sized checkpoint for several bounce
sizes, read piece sizes and thread counts.

One CUDA device. A state of ``--tensors`` fp32 tensors of ``--mib`` MiB each (default 18 x
256 MiB = 4.5 GiB, the shape of ``bench/gpu.py``'s 6 x Linear(8192) + AdamW) is saved once
with a Checkpointer (direct D2H), then each variant restores it twice into the scrambled
live tensors: first with a fresh buffer pool (its buffers are made as readers need them,
as in a new process) and again with the pool kept; each is checked bitwise. Also timed:
making 512 MiB of page-locked memory with ``torch.empty(pin_memory=True)`` and by
page-locking a populated anonymous mapping (``cudaHostRegister``), and the H2D floor
(one pinned buffer of the state's size, one copy per tensor).

    PYTHONPATH=src python bench/gpu_restore_sweep.py --out restore-sweep.json
    PYTHONPATH=src python bench/gpu_restore_sweep.py --cpu-smoke   # the script itself, tiny, on the CPU
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import scratch_dir  # noqa: E402 - bench/ is not a package

VARIANTS = [  # (bounce MiB, piece MiB, threads)
    (4, 1, 16), (16, 1, 16), (32, 1, 16), (16, 2, 16), (16, 1, 8), (64, 1, 16), (16, 1, 12),
]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def restore_once(folder: str, step: int, state: dict[str, torch.Tensor], workers: int, smoke: bool) -> float:
    from incluster.recovery.landing import Landing, direct_targets, read_verified, segments
    from incluster.tiers.local import open_shard

    sync()
    t0 = time.perf_counter()
    fd, sc, header, path = open_shard(folder, step)
    try:
        targets = direct_targets(state, sc.tree, header, allow_pickle=False, big=1, devices=("cpu", "cuda"))
        landing = Landing(header, segments(header, big=1), targets)
        if len(landing.placed) != len(state):
            raise RuntimeError(f"only {len(landing.placed)} of {len(state)} tensors land in place")
        read_verified(fd, landing, sc.checksum, path, workers=workers, bounce_cpu=smoke)
    finally:
        os.close(fd)
    sync()
    return time.perf_counter() - t0


def alloc_costs(nbytes: int) -> dict[str, float]:
    from incluster.staging.cuda import host_register, host_unregister

    out: dict[str, float] = {}
    t0 = time.perf_counter()
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out["pin_memory_s"] = time.perf_counter() - t0
    del t
    t0 = time.perf_counter()
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    out["mmap_populate_s"] = time.perf_counter() - t0
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    t0 = time.perf_counter()
    err = host_register(buf.data_ptr(), nbytes, 0)
    out["host_register_s"] = time.perf_counter() - t0
    if err is None:
        host_unregister(buf.data_ptr(), 0)
    else:
        out["host_register_error"] = err  # type: ignore[assignment]
    del buf
    mm.close()
    return out


def file_register(folder: str, step: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The other way to restore: page-lock a mapping of the shard file itself and copy to
    the GPU straight from it (no bounce copy). What that costs: mapping it, page-locking
    it, the H2D copies from it, unlocking it."""
    from incluster.staging.cuda import host_register, host_unregister
    from incluster.tiers.local import open_shard

    ro, sc, header, path = open_shard(folder, step)
    os.close(ro)
    fd = os.open(path, os.O_RDWR)  # page-locking a mapping needs it writable (or cudaHostRegisterReadOnly)
    out: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, sc.checksum.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
        out["map_populate_s"] = time.perf_counter() - t0
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        t0 = time.perf_counter()
        err = host_register(buf.data_ptr(), buf.numel(), 0)
        out["register_s"] = time.perf_counter() - t0
        if err is not None:
            out["error"] = err
            return out
        try:
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for name, dst in state.items():
                    t = header.tensors[name]
                    dst.view(torch.uint8).copy_(buf[t.offset : t.offset + t.nbytes], non_blocking=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out["h2d_s"] = times
        finally:
            t0 = time.perf_counter()
            host_unregister(buf.data_ptr(), 0)
            out["unregister_s"] = time.perf_counter() - t0
        del buf
        mm.close()
    finally:
        os.close(fd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="restore-sweep.json")
    ap.add_argument("--tensors", type=int, default=18)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--cpu-smoke", action="store_true", help="2 x 1 MiB CPU tensors through the same path")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.tensors, args.mib = 2, 1
    elif not torch.cuda.is_available():
        print("gpu_restore_sweep.py: no CUDA device; nothing measured")
        return 0
    import incluster
    from incluster.recovery import device_landing, landing
    from incluster.tiers.local import rank_folder

    dev = "cpu" if args.cpu_smoke else "cuda"
    n = args.mib << 18  # fp32 elements
    g = torch.Generator(device=dev).manual_seed(0)
    state = {f"t{i}": torch.randn(n, device=dev, generator=g) for i in range(args.tensors)}
    ref = {k: v.clone() for k, v in state.items()}
    nbytes = sum(v.nbytes for v in state.values())
    report: dict[str, Any] = {"bytes": nbytes, "torch": torch.__version__, "cores": os.cpu_count(), "runs": []}
    report["alloc_512mib"] = {} if args.cpu_smoke else alloc_costs(512 << 20)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=not args.cpu_smoke)
    views, at = [], 0
    for v in state.values():
        views.append(pinned[at : at + v.nbytes].view(torch.float32))
        at += v.nbytes
    for dst, src in zip(views, state.values()):
        dst.copy_(src)
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for dst, src in zip(state.values(), views):
            dst.copy_(src, non_blocking=True)
        sync()
        times.append(time.perf_counter() - t0)
    report["h2d_floor_s"] = min(times)
    del views, pinned
    print(f"H2D floor {report['h2d_floor_s'] * 1e3:.1f} ms for {nbytes / 2**30:.2f} GiB; alloc {report['alloc_512mib']}",
          flush=True)
    with scratch_dir("bench-restore-sweep-") as root:
        with incluster.Checkpointer(local_dir=root, job="sweep", replicas=0, gpu_snapshot=0) as ck:
            ck.save(1, state).wait(300)
        folder = rank_folder(root, "sweep", 0)
        if not args.cpu_smoke:
            report["file_register"] = file_register(folder, 1, state)
            print(f"page-locking the shard file's mapping: {report['file_register']}", flush=True)
        bounce0, piece0 = device_landing.BOUNCE, landing.PIECE
        try:
            for bounce_mib, piece_mib, workers in VARIANTS:
                device_landing.BOUNCE, landing.PIECE = bounce_mib << 20, piece_mib << 20
                device_landing._pools.clear()
                run: dict[str, Any] = {"bounce_mib": bounce_mib, "piece_mib": piece_mib, "threads": workers}
                try:
                    secs = []
                    for _ in range(2):
                        for v in state.values():
                            v.fill_(float("nan"))
                        secs.append(restore_once(folder, 1, state, workers, args.cpu_smoke))
                        run.setdefault("bitwise", []).append(all(torch.equal(state[k], ref[k]) for k in state))
                    run.update(first_s=secs[0], next_s=secs[1], first_x=secs[0] / report["h2d_floor_s"],
                               next_x=secs[1] / report["h2d_floor_s"])
                except Exception as exc:  # noqa: BLE001 - one variant failing keeps the rest
                    run["error"] = f"{type(exc).__name__}: {exc}"
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
        finally:
            device_landing.BOUNCE, landing.PIECE = bounce0, piece0
            device_landing._pools.clear()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
