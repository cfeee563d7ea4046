"""Helpers shared by the benchmarks in ``bench/``: sizes, synthetic states, scratch
folders in the RAM disk, the copy floor, medians and table printing, the training
benches' model and their DCP async-save wrapper (``DcpAsyncSaver``).

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


def source_commit() -> str | None:
    """The commit of the library measured ("+dirty" where src/ has uncommitted changes)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=root, capture_output=True, text=True).stdout
        return head + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


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


class DcpAsyncSaver:
    """DCP's ``async_save`` used the way its docs ask: one save in flight, the previous
    upload waited for first; staging must end before the optimizer changes the state
    (``wait_staged()``). Keeps the newest two checkpoint folders, removing older ones on
    a background thread. A bench subclasses it for the shape of its records
    (``record()``, ``uploaded()``); ``save()`` returns the record and keeps it in
    ``records``; ``close()`` waits for the last upload and returns the seconds it took.

    ``process``: the process executor (else the thread one); ``stager``: a kept
    ``DefaultStager`` (else DCP's default); ``remove_old``: whether this rank removes
    the old folders (one rank is enough on a shared file system).
    """

    def __init__(self, root: str, *, process: bool, stager: bool = True, process_group: Any = None,
                 sync_files: bool = True, remove_old: bool = True) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.root = root
        self.ctype = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.stager: Any = None
        if stager:
            # (pinned, shared, async staging, non-blocking copy): pinned and non-blocking
            # need an accelerator; shared memory only pays off with the process executor.
            self.stager = DefaultStager(StagingOptions(False, process, True, False))
        self.pg = process_group
        self.sync_files = sync_files
        self.remove_old = remove_old
        self.upload: Any = None
        self.staging: Any = None
        self.folders: list[str] = []
        self.cleaner = ThreadPoolExecutor(1)
        self.records: list[dict[str, Any]] = []

    def record(self, step: int, path: str, t0: float, t1: float, t2: float, wait_prev: float) -> dict[str, Any]:
        """A new save's record: ``t0`` before waiting for the previous upload, ``t1``
        right before ``async_save``, ``t2`` right after. Must hold ``staged_s``."""
        raise NotImplementedError

    def uploaded(self, rec: dict[str, Any], f: Any, seconds: float) -> None:
        """The save's upload ended (future ``f``), ``seconds`` after ``t1``."""
        raise NotImplementedError

    def wait_staged(self) -> float:
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self.staging.result()
        self.staging = None
        return time.perf_counter() - t0

    def save(self, step: int, model: Any, optim: Any) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        wait_prev = 0.0
        if self.upload is not None:
            self.upload.result()
            wait_prev = time.perf_counter() - t0
        # Keep the newest two checkpoints (like persistent_keep=2); a folder goes once a
        # newer save is complete everywhere (the previous upload ended on every rank).
        while len(self.folders) >= 2:
            old = self.folders.pop(0)
            if self.remove_old:
                self.cleaner.submit(shutil.rmtree, old, True)
        path = os.path.join(self.root, f"step-{step:09d}")
        self.folders.append(path)
        sd = {"model": model.state_dict(), "optim": optim.state_dict()}
        writer = dcp.FileSystemWriter(path, sync_files=self.sync_files)
        kwargs: dict[str, Any] = {"storage_writer": writer, "async_checkpointer_type": self.ctype}
        if self.pg is not None:
            kwargs["process_group"] = self.pg
        if self.stager is not None:
            kwargs["async_stager"] = self.stager
        t1 = time.perf_counter()
        resp = dcp.async_save(sd, **kwargs)
        t2 = time.perf_counter()
        if hasattr(resp, "upload_completion"):
            self.upload, self.staging = resp.upload_completion, resp.staging_completion
        else:  # a plain future: staging happened inside the call
            self.upload, self.staging = resp, None
        rec = self.record(step, path, t0, t1, t2, wait_prev)
        if self.staging is not None:
            self.staging.add_done_callback(lambda _f, r=rec: r.__setitem__("staged_s", time.perf_counter() - t1))
        else:
            rec["staged_s"] = t2 - t1
        self.upload.add_done_callback(lambda f, r=rec: self.uploaded(r, f, time.perf_counter() - t1))
        self.records.append(rec)
        return rec

    def close(self) -> float:
        t0 = time.perf_counter()
        try:
            if self.upload is not None:
                self.upload.result()
        finally:
            if self.stager is not None:
                self.stager.close()
            self.cleaner.shutdown(wait=True)
        return time.perf_counter() - t0
