"""``bench/persistent.py``'s upload throughput alone: ``FsspecTier.write`` from a mapped
RAM-disk shard against a plain copy + fsync of the same file into the same target."""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from typing import Any


def _fsync_path(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def upload_throughput(src: str, target: str, repeats: int) -> dict[str, Any]:
    """Interleaved: incluster's tier write of ``src`` mapped (as the writer maps its slot)
    and shutil.copyfile of ``src`` + fsync of the file and its folder, into ``target``."""
    from incluster.tiers.persistent import FsspecTier

    size = os.path.getsize(src)
    tier_root = os.path.join(target, "tier")
    plain_dir = os.path.join(target, "plain")
    os.makedirs(plain_dir, exist_ok=True)
    tier = FsspecTier(tier_root)
    inc: list[float] = []
    plain: list[float] = []
    fd = os.open(src, os.O_RDWR)  # mapped the way the writer maps a slot (CommitService._map)
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    try:
        def run_inc() -> None:
            t0 = time.perf_counter()
            tier.write("job/step-000000000000/rank-00000.safetensors", memoryview(mm))
            inc.append(time.perf_counter() - t0)
            shutil.rmtree(tier_root, ignore_errors=True)

        def run_plain() -> None:
            dst = os.path.join(plain_dir, "rank-00000.safetensors")
            t0 = time.perf_counter()
            shutil.copyfile(src, dst)
            _fsync_path(dst)
            _fsync_path(plain_dir)
            plain.append(time.perf_counter() - t0)
            os.unlink(dst)

        for r in range(-1, repeats):  # round -1: warm-up (first writes into fresh disk space), dropped
            for fn in ((run_inc, run_plain) if r % 2 == 0 else (run_plain, run_inc)):
                os.sync()  # start each from a clean disk queue (nothing of ours left dirty)
                fn()
            if r == -1:
                inc.clear()
                plain.clear()
    finally:
        mm.close()
        shutil.rmtree(tier_root, ignore_errors=True)
        shutil.rmtree(plain_dir, ignore_errors=True)
    mi, mp = statistics.median(inc), statistics.median(plain)
    return {"bytes": size, "incluster_s": inc, "plain_s": plain, "incluster_median_s": mi, "plain_median_s": mp,
            "incluster_Bps": size / mi, "plain_Bps": size / mp, "ratio": mp / mi,
            "incluster_best_Bps": size / min(inc), "plain_best_Bps": size / min(plain)}
