"""Helpers shared by the benchmarks in ``bench/``: sizes, synthetic states, scratch
folders in the RAM disk, the copy floor, medians and table printing.

Nothing here imports incluster: the helpers measure any checkpointing system alike.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import torch

RAM_DISK = "/dev/shm"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"512M"`` -> 536870912; binary units K/M/G/T (an optional trailing ``iB``/``B``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {text!r}: use e.g. 512M, 2G, 64K")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]} {unit}iB"
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f} {unit}iB"
    return f"{n} B"


def make_state(total_bytes: int, n_tensors: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A flat dict of ``n_tensors`` contiguous tensors holding ``total_bytes`` in all.

    Sizes vary like a model's (a few big matrices, many small vectors): tensor ``i`` gets
    a share proportional to a repeating 1..16 ramp squared, and 2-D shapes where they fit.
    Every page is written once here, so later copies out of the state never fault.
    """
    esize = torch.empty(0, dtype=dtype).element_size()
    total = total_bytes // esize
    if n_tensors < 1 or total < n_tensors:
        raise ValueError(f"cannot split {total_bytes} bytes into {n_tensors} tensors")
    weights = [((i % 16) + 1) ** 2 for i in range(n_tensors)]
    wsum = sum(weights)
    counts = [max(1, total * w // wsum) for w in weights]
    counts[-1] += total - sum(counts)
    if counts[-1] < 1:  # cannot happen for sane inputs; keep the invariant explicit
        raise ValueError("tensor split went negative")
    state: dict[str, torch.Tensor] = {}
    for i, n in enumerate(counts):
        cols = 1024 if n % 1024 == 0 and n >= 4096 else 1
        shape = (n // cols, cols) if cols > 1 else (n,)
        t = torch.empty(shape, dtype=dtype)
        t.fill_(float(i % 97) / 97.0)
        state[f"layers.{i}.{'weight' if cols > 1 else 'bias'}"] = t
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def mutate(state: dict[str, torch.Tensor], step: int) -> None:
    """Change a few values, like an optimizer step would (but cheaply)."""
    tensors = list(state.values())
    for t in (tensors[0], tensors[len(tensors) // 2], tensors[-1]):
        t.view(-1)[step % t.numel()].add_(1.0)


@contextlib.contextmanager
def scratch_dir(prefix: str, root: str = RAM_DISK) -> Iterator[str]:
    """A fresh folder in the RAM disk, removed afterwards whatever happens."""
    path = tempfile.mkdtemp(prefix=prefix, dir=root if os.path.isdir(root) else None)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()


def floor_copy(nbytes: int, repeats: int) -> list[float]:
    """Seconds per ``copy_`` of ``nbytes`` from one contiguous tensor into another that
    was allocated and touched beforehand (the best a copy can do on this machine)."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)  # first touch: every page of the destination is faulted in now
    dst.copy_(src)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del src, dst
    gc.collect()
    return times


def loop_copy(state: dict[str, torch.Tensor], repeats: int, background: bool = False) -> list[float]:
    """Seconds per loop of one ``copy_`` per tensor into views of one reused, touched
    buffer: the floor for a state made of many tensors. ``background``: run the loop on a
    worker thread (where checkpointers stage), to expose any per-thread cost there."""
    tensors = list(state.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(buf[off : off + n].view(t.dtype).view(t.shape))
        off += n

    def once() -> float:
        t0 = time.perf_counter()
        for d, s in zip(views, tensors):
            d.copy_(s)
        return time.perf_counter() - t0

    try:
        if background:
            with ThreadPoolExecutor(1) as ex:
                ex.submit(once).result()
                return [ex.submit(once).result() for _ in range(max(1, repeats))]
        once()
        return [once() for _ in range(max(1, repeats))]
    finally:
        del views, buf
        gc.collect()


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ms(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "—"
    v = x * 1e3
    if v < 10:
        return f"{v:.{max(digits, 2)}f}"
    return f"{v:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "—"
    r = a / b
    if r < 0.1:
        return f"{r:.4f}x"
    return f"{r:.2f}x"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None) -> str:
    """A pipe table that reads well in a terminal and pastes into Markdown unchanged."""
    right = list(right) if right is not None else [i > 0 for i in range(len(headers))]
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for c, w, r in zip(cells, widths, right):
            out.append(str(c).rjust(w) if r else str(c).ljust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if r else (":" + "-" * (w + 1)) for w, r in zip(widths, right)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import psutil

        info["ram_bytes"] = psutil.virtual_memory().total
        if os.path.isdir(RAM_DISK):
            info["ram_disk_free_bytes"] = shutil.disk_usage(RAM_DISK).free
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def rss_bytes() -> int | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001
        return None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_mlp(hidden: int, layers: int) -> torch.nn.Module:
    """``layers`` x ``Linear(hidden, hidden)`` with a ReLU between each two, seeded with
    ``torch.manual_seed(0)``: the same weights in every process (like a broadcast
    initialisation). The training benches' model."""
    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])
