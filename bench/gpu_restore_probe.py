"""Where does a restore into GPU tensors spend its time? Rates of each part, alone and piped.

A diagnostic for ``bench/gpu.py``'s restore (3.1x the host-to-device floor): one shard-
sized file in /dev/shm is read into page-locked 16 MiB buffers, hashed and copied to the
GPU, each part alone and then together, on 1 to 16 threads:

  pread        os.preadv from the file into page-locked buffers
  mmap-copy    a copy out of a populated shared mapping of the file (no system calls)
  hash         xxh3-64 over page-locked memory already read
  h2d          non-blocking host-to-device copies from the buffers, one stream per buffer
  pipe-pread   pread 1 MiB, hash it, then the 16 MiB buffer's host-to-device copy
  pipe-mmap    the same with copies out of the mapping

GB/s per variant and thread count, JSON to --out.

    PYTHONPATH=src python bench/gpu_restore_probe.py --out restore-probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import xxhash

BUF = 16 << 20
PIECE = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="restore-probe.json")
    ap.add_argument("--gib", type=float, default=4.5)
    ap.add_argument("--threads", default="1,4,8,16")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    n = int(args.gib * 2**30) // BUF * BUF
    threads = [int(t) for t in args.threads.split(",")]
    out: dict[str, Any] = {"bytes": n, "cuda": cuda, "cores": os.cpu_count(), "torch": torch.__version__}
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="bench-restore-probe-")
    try:
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        chunk = torch.empty(BUF, dtype=torch.uint8, pin_memory=cuda)
        for at in range(0, n, BUF):
            chunk.copy_(src[at : at + BUF])
            os.pwrite(fd, memoryview(chunk.numpy()), at)
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        nbuf = 2 * max(threads)
        bufs = [torch.empty(BUF, dtype=torch.uint8, pin_memory=cuda) for _ in range(nbuf)]
        views = [memoryview(b.numpy()) for b in bufs]
        streams = [torch.cuda.Stream() if cuda else None for _ in range(nbuf)]
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        out["mmap_populate_s"] = time.perf_counter() - t0
        whole = torch.frombuffer(mm, dtype=torch.uint8)

        def h2d(i: int, at: int) -> None:
            if cuda:
                with torch.cuda.stream(streams[i]):
                    dst[at : at + BUF].copy_(bufs[i], non_blocking=True)
                streams[i].synchronize()
            else:
                dst[at : at + BUF].copy_(bufs[i])

        def pread(i: int, at: int) -> None:
            os.preadv(fd, [views[i]], at)

        def mcopy(i: int, at: int) -> None:
            bufs[i].copy_(whole[at : at + BUF])

        def hash_(i: int, at: int) -> None:
            xxhash.xxh3_64_intdigest(views[i])

        def pipe(read_piece: Callable[[int, int, int], None]) -> Callable[[int, int], None]:
            def run(i: int, at: int) -> None:
                for p in range(0, BUF, PIECE):
                    read_piece(i, at, p)
                    xxhash.xxh3_64_intdigest(views[i][p : p + PIECE])
                h2d(i, at)
            return run

        def pread_piece(i: int, at: int, p: int) -> None:
            os.preadv(fd, [views[i][p : p + PIECE]], at + p)

        def mmap_piece(i: int, at: int, p: int) -> None:
            bufs[i][p : p + PIECE].copy_(whole[at + p : at + p + PIECE])

        parts: dict[str, Callable[[int, int], None]] = {
            "pread": pread, "mmap-copy": mcopy, "hash": hash_, "h2d": h2d,
            "pipe-pread": pipe(pread_piece), "pipe-mmap": pipe(mmap_piece),
        }
        torch.set_num_threads(1)  # each copy on the calling thread: the pool is the parallelism
        for name, fn in parts.items():
            res = {}
            for t in threads:
                def worker(w: int) -> None:
                    for k, at in enumerate(range(w * BUF, n, t * BUF)):
                        fn(w * 2 + (k & 1), at)

                with ThreadPoolExecutor(t) as pool:
                    list(pool.map(worker, range(t)))  # warm
                    t0 = time.perf_counter()
                    list(pool.map(worker, range(t)))
                    dt = time.perf_counter() - t0
                res[t] = round(n / dt / 1e9, 2)
            out[name] = res
            print(f"{name:11s} GB/s by threads: {res}", flush=True)
        if cuda:
            ok = torch.equal(dst[:BUF], src[:BUF])
            out["bytes_ok"] = bool(ok)
        del whole
        try:
            mm.close()
        except BufferError:
            pass
    finally:
        os.close(fd)
        os.unlink(path)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
