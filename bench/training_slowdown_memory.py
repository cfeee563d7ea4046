"""``bench/training_slowdown.py``'s memory watch: the peak memory one configuration's job
holds (its ranks and every process they start), sampled while it runs."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any


def _pss_kib(pid: int) -> int:
    """Pss_Anon + Pss_Shmem of one process, KiB: its private memory plus its share of
    the shared memory it maps (slot files, DCP's shared staging); 0 once it is gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                    total += int(line.split()[1])
    except OSError:
        pass
    return total


def _tree_bytes(path: str) -> int:
    n = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                n += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return n


class MemWatch:
    """Samples, while a configuration runs, the memory its job holds: Pss_Anon +
    Pss_Shmem summed over the ranks and every process they started (writers, DCP's
    checkpoint process), plus the RAM-disk files DCP writes (never mapped). Other
    processes on the machine do not count. Also the machine's used memory, for scale."""

    def __init__(self, unmapped_dir: str, period: float = 0.25) -> None:
        import psutil

        self._psutil = psutil
        self.unmapped_dir = unmapped_dir
        self.pids: list[int] = []
        self.peak = 0
        self.machine_base = self._machine()
        self.machine_peak = self.machine_base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(period,), daemon=True)

    def _machine(self) -> int:
        vm = self._psutil.virtual_memory()
        return int(vm.total - vm.available)

    def sample(self) -> None:
        pids = set(self.pids)
        for pid in self.pids:
            with contextlib.suppress(Exception):
                pids.update(c.pid for c in self._psutil.Process(pid).children(recursive=True))
        used = sum(_pss_kib(p) for p in pids) * 1024 + _tree_bytes(self.unmapped_dir)
        self.peak = max(self.peak, used)
        self.machine_peak = max(self.machine_peak, self._machine())

    def _loop(self, period: float) -> None:
        while not self._stop.wait(period):
            with contextlib.suppress(Exception):
                self.sample()

    def __enter__(self) -> "MemWatch":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
