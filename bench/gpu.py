"""What does a checkpoint cost a GPU training loop? incluster against the copy floors and DCP.

One process, one CUDA device. The state: ``--layers`` x ``Linear(--hidden, --hidden,
bias=False)`` in fp32 with AdamW (default 6 x 8192^2: 1.5 GiB of parameters, 4.5 GiB
with the two moments, 18 device tensors after the first step). One training step: bf16
autocast forward, loss ``out.float().pow(2).mean()``, backward, ``optim.step()``,
``zero_grad(set_to_none=True)``, ``loss.item()`` (a sync each step, as real loops have);
each step is timed whole with ``perf_counter``. Two batch sizes: ``--tokens-compute``
(a step takes longer than copying the state to the host) and ``--tokens-copy`` (copying
the state out takes longer than a forward + backward). Every configuration rebuilds the
model from the same seed and runs 2 warm-up steps first. In this order:

  floors     (a) D2H of the device tensors, one non_blocking copy_ each, into
             ``torch.empty(pin_memory=True)`` buffers; (b) the same into a mapping of a
             file in /dev/shm (posix_fallocate, MAP_SHARED|MAP_POPULATE) page-locked with
             cudaHostRegister: already registered RAM-disk memory, where incluster's slots
             live; (c) H2D from the pinned buffers into the live tensors; (d) D2D into
             ``empty_like`` tensors. Median of 3 after one warm-up copy, and GB/s.
  baseline   the loop without checkpointing, per batch size
  incluster  Checkpointer(replicas=0, keep=2) with gpu_snapshot=None (automatic: a
             device-side snapshot when memory allows) and gpu_snapshot=0 (direct D2H into
             the pinned RAM-disk slot), ``prepare(state)`` after the warm-up, a save right
             after ``zero_grad`` every 10 steps; per save the handle's blocked / staged /
             durable seconds (from save()), medians without the first save, also as
             multiples of floors (b) and (a); step inflation against the baseline
  restore    (after the last every-10 incluster run, gpu_snapshot=0) a final save waited
             for, the state cloned on the device, the live tensors scrambled, then a new
             Checkpointer ``load``s it (2x): seconds, x floor (c), bitwise check
  dcp        torch.distributed.checkpoint.async_save in its default configuration (no
             stager given; one process, no process group) into /dev/shm, 3 saves every 10
             steps per batch size; its staging is waited for before the optimizer step
             after a save; then ``dcp.load`` of the last save (2x, bitwise check)
  every k    the incluster runs again with a save every k steps,
             k = max(2, ceil(floor (b) / baseline median step))
  dcp kept   (if time is left) DCP's best GPU setting, a kept
             DefaultStager(StagingOptions(True, False, True, True)), copy-bound, every 10:
             its numbers, or the error it ends with

Each configuration runs in try/except (an error is recorded and the run goes on), writes
into a fresh folder under /dev/shm that is removed whatever happens, and the JSON file is
rewritten after each one, so a run cut short keeps what it measured. A configuration is
skipped once the elapsed time plus the last duration of its kind would pass --budget-s.
Without CUDA it exits 0 at once (JSON ``{"skipped": "no CUDA"}``), unless --cpu-smoke:
then the same code runs on the CPU with tiny sizes (no pinned or registered memory, CPU
bf16 autocast), to check the script itself.

    python bench/gpu.py                                   # H200: about 3 minutes
    python bench/gpu.py --quick                           # small model, few steps
    PYTHONPATH=src python bench/gpu.py --cpu-smoke --out /tmp/gpu-smoke.json
    python bench/gpu.py --report gpu-bench.json           # print a saved run's table
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the budget counts the imports too

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RAM_DISK, log, machine_info, median, scratch_dir  # noqa: E402 - bench/ is not a package
from gpu_report import config_name, loop_summary, render, save_summary, step_stats, write_json  # noqa: E402

WAIT_S = 60.0  # the longest wait for saves or uploads before a configuration counts as stuck
ALIGN = 4096


def elapsed() -> float:
    return time.perf_counter() - T_START


# -- the model and the loop --------------------------------------------------------------


def build(args: argparse.Namespace, tokens: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.hidden, args.hidden, bias=False, device=args.dev)
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
              pre_step: Callable[[], Any] | None = None, after: Callable[[int], Any] | None = None) -> list[float]:
    """``steps`` timed steps; ``save(i)`` right after ``zero_grad`` of the steps in ``save_at``;
    ``after(i)`` once step i's time is taken."""
    times = []
    for i in range(steps):
        hook = (lambda i=i: save(i)) if save is not None and i in save_at else None  # type: ignore[misc]
        t0 = time.perf_counter()
        train_step(args, model, optim, x, pre_step, hook)
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(i)
    return times


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


# -- configurations ----------------------------------------------------------------------


def run_baseline(args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    model, optim, x = build(args, tokens)
    warm_up(args, model, optim, x)
    times = run_steps(args, model, optim, x, args.steps)
    return {"tokens": tokens, "steps_s": times, "stats": step_stats(times)}


def incluster_features() -> dict[str, Any]:
    import incluster

    return {
        "path": os.path.dirname(os.path.abspath(incluster.__file__)),
        "gpu_snapshot_option": "gpu_snapshot" in inspect.signature(incluster.config.resolve).parameters,
        "prepare": hasattr(incluster.Checkpointer, "prepare"),
    }


def checkpointer(args: argparse.Namespace, root: str, job: str, mode: str | None, **more: Any) -> Any:
    import incluster

    opts: dict[str, Any] = dict(local_dir=root, job=job, replicas=0, slot_timeout_s=WAIT_S, **more)
    if mode is not None and args.features["gpu_snapshot_option"]:
        opts["gpu_snapshot"] = None if mode == "snapshot" else 0
    return incluster.Checkpointer(**opts)


def run_incluster(args: argparse.Namespace, report: dict[str, Any], kind: str, tokens: int, mode: str, every: int,
                  restore: bool) -> dict[str, Any]:
    res: dict[str, Any] = {"system": "incluster", "mode": mode, "tokens": tokens, "every": every}
    model, optim, x = build(args, tokens)
    state = {"model": model, "optim": optim}
    warm_up(args, model, optim, x)
    with scratch_dir("bench-gpu-inc-") as root:
        job = f"gpu-{mode}-{kind}-{every}-{os.getpid()}"
        t0 = time.perf_counter()
        ckpt = checkpointer(args, root, job, mode, keep=2)
        res["construct_s"] = time.perf_counter() - t0
        try:
            if hasattr(ckpt, "prepare"):
                t0 = time.perf_counter()
                ckpt.prepare(state).result(WAIT_S)
                res["prepare_s"] = time.perf_counter() - t0
            res["gpu_snapshot_active_after_prepare"] = getattr(ckpt, "gpu_snapshot_active", None)
            handles: list[tuple[int, Any]] = []
            save_at = set(range(0, args.steps, every))
            times = run_steps(args, model, optim, x, args.steps, save_at,
                              lambda i: handles.append((i, ckpt.save(args.warmup + i, state))))
            t0 = time.perf_counter()
            ckpt.wait(WAIT_S)
            res["wait_end_s"] = time.perf_counter() - t0
            res["gpu_snapshot_active"] = getattr(ckpt, "gpu_snapshot_active", None)
            res["steps_s"] = times
            res["saves"] = [{"i": i, "step": h.step, "blocked_s": h.blocked_s, "staged_s": h.staged_s,
                             "durable_s": h.durable_s} for i, h in handles]
            res["saves_summary"] = save_summary(res["saves"], report.get("floors") or {})
            base = ((report["baseline"].get(kind) or {}).get("stats") or {}).get("mean_s")
            res["loop"] = loop_summary(times, [i for i, _ in handles], base)
            if restore:
                try:
                    report["restore"] = run_restore(args, root, job, ckpt, model, optim, args.warmup + args.steps)
                except Exception as exc:  # noqa: BLE001 - keep this configuration's numbers
                    report["restore"] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
                    log(f"  restore FAILED: {exc}")
        finally:
            ckpt.close()
    return res


def run_restore(args: argparse.Namespace, root: str, job: str, ckpt: Any, model: Any, optim: Any,
                final_step: int) -> dict[str, Any]:
    state = {"model": model, "optim": optim}
    sync(args)
    ref = [(n, t.clone()) for n, t in named_tensors(model, optim)]
    out: dict[str, Any] = {"step_saved": final_step}
    t0 = time.perf_counter()
    ckpt.save(final_step, state).wait(WAIT_S)
    out["final_save_s"] = time.perf_counter() - t0
    ckpt.close()
    t0 = time.perf_counter()
    ckpt2 = checkpointer(args, root, job, "direct")
    out["construct_s"] = time.perf_counter() - t0
    runs = []
    try:
        for _ in range(args.restore_repeats):
            scramble(model, optim)
            sync(args)
            t0 = time.perf_counter()
            step = ckpt2.load(state)
            sync(args)
            dt = time.perf_counter() - t0
            ok, bad = same_bits(ref, named_tensors(model, optim))
            rep = getattr(ckpt2, "last_restore", None)
            runs.append({"s": dt, "step": step, "bitwise": ok, "mismatches": bad,
                         "line": rep.line() if rep is not None and hasattr(rep, "line") else None})
            log(f"  restore: {dt * 1e3:.0f} ms, step {step}, bitwise {ok}")
    finally:
        ckpt2.close()
    secs = [r["s"] for r in runs]
    out.update(runs=runs, seconds=secs, min_s=min(secs), median_s=median(secs),
               bitwise=all(r["bitwise"] and r["step"] == final_step for r in runs), line=runs[-1]["line"])
    return out


class DcpRun:
    """dcp.async_save the way its docs ask: the previous upload waited for before the next
    call, staging waited for before the optimizer changes the state. ``stager``: a kept
    DefaultStager's StagingOptions, else DCP's default (none given). The newest two
    checkpoint folders are kept (like keep=2), older ones removed on a background thread."""

    def __init__(self, root: str, stager: tuple[bool, bool, bool, bool] | None) -> None:
        self.root, self.stager = root, None
        if stager is not None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(*stager))
        self.upload: Any = None
        self.staging: Any = None
        self.folders: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.cleaner = ThreadPoolExecutor(1, thread_name_prefix="bench-dcp-clean")

    def save(self, step: int, model: Any, optim: Any) -> None:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        if self.upload is not None:
            self.upload.result(WAIT_S)
        while len(self.folders) >= 2:
            self.cleaner.submit(shutil.rmtree, self.folders.pop(0), True)
        path = os.path.join(self.root, f"step-{step:09d}")
        self.folders.append(path)
        sd = {"model": model.state_dict(), "optim": optim.state_dict()}
        kw: dict[str, Any] = {"checkpoint_id": path}
        if self.stager is not None:
            kw["async_stager"] = self.stager
        t1 = time.perf_counter()
        resp = dcp.async_save(sd, **kw)
        t2 = time.perf_counter()
        rec: dict[str, Any] = {"step": step, "blocked_s": t2 - t1, "wait_prev_s": t1 - t0, "staged_s": None,
                               "durable_s": None, "error": None}
        self.records.append(rec)
        if hasattr(resp, "upload_completion"):  # AsyncSaveResponse: staging may go on after the call
            self.upload, self.staging = resp.upload_completion, resp.staging_completion
            self.staging.add_done_callback(lambda _f, r=rec, t=t1: r.__setitem__("staged_s", time.perf_counter() - t))
        else:  # a plain future: staged inside the call
            self.upload, self.staging = resp, None
            rec["staged_s"] = t2 - t1
        self.upload.add_done_callback(lambda f, r=rec, t=t1: self._uploaded(r, f, time.perf_counter() - t))

    @staticmethod
    def _uploaded(rec: dict[str, Any], f: Any, seconds: float) -> None:
        exc = f.exception()
        rec["durable_s"] = seconds if exc is None else None
        rec["error"] = None if exc is None else f"{type(exc).__name__}: {exc}"

    def wait_staged(self) -> None:
        if self.staging is not None:
            self.staging.result(WAIT_S)
            self.staging = None

    def close(self) -> float:
        t0 = time.perf_counter()
        try:
            if self.upload is not None:
                self.upload.result(WAIT_S)
        finally:
            try:
                if self.stager is not None:
                    self.stager.close()
            finally:
                self.cleaner.shutdown(wait=True)
        return time.perf_counter() - t0


def run_dcp(args: argparse.Namespace, report: dict[str, Any], kind: str, tokens: int,
            stager: tuple[bool, bool, bool, bool] | None, load: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    every = args.every
    res: dict[str, Any] = {"system": "dcp", "tokens": tokens, "every": every, "stager": stager,
                           "dist_initialized": dist.is_available() and dist.is_initialized()}
    model, optim, x = build(args, tokens)
    warm_up(args, model, optim, x)
    steps = args.dcp_saves * every
    last = (args.dcp_saves - 1) * every
    ref: list[tuple[str, torch.Tensor]] = []

    def after(i: int) -> None:  # the state as the last save saw it (unchanged until the next optim.step)
        if load and i == last:
            sync(args)
            ref.extend((n, t.clone()) for n, t in named_tensors(model, optim))

    with scratch_dir("bench-gpu-dcp-") as root:
        run = DcpRun(root, stager)
        try:
            times = run_steps(args, model, optim, x, steps, set(range(0, steps, every)),
                              lambda i: run.save(args.warmup + i, model, optim), run.wait_staged, after)
        finally:
            try:
                res["close_s"] = run.close()
            finally:
                res["saves"] = run.records
        res["steps_s"] = times
        errs = [r["error"] for r in run.records if r.get("error")]
        if errs:
            res["error"] = errs[0]
        res["saves_summary"] = save_summary(run.records, report.get("floors") or {})
        base = ((report["baseline"].get(kind) or {}).get("stats") or {}).get("mean_s")
        res["loop"] = loop_summary(times, sorted(set(range(0, steps, every))), base)
        if load and ref and run.folders:
            out: dict[str, Any] = {"runs": []}
            try:
                for _ in range(args.restore_repeats):
                    scramble(model, optim)
                    sync(args)
                    t0 = time.perf_counter()
                    dcp.load({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=run.folders[-1])
                    sync(args)
                    dt = time.perf_counter() - t0
                    ok, bad = same_bits(ref, named_tensors(model, optim))
                    out["runs"].append({"s": dt, "bitwise": ok, "mismatches": bad})
                    log(f"  dcp.load: {dt * 1e3:.0f} ms, bitwise {ok}")
            except Exception as exc:  # noqa: BLE001
                out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            secs = [r["s"] for r in out["runs"]]
            if secs:
                out.update(seconds=secs, min_s=min(secs), median_s=median(secs),
                           bitwise=all(r["bitwise"] for r in out["runs"]))
            report["dcp_load"] = out
    return res


def run_dcp_config(args: argparse.Namespace, report: dict[str, Any], kind: str, tokens: int,
                   stager: tuple[bool, bool, bool, bool] | None, load: bool) -> dict[str, Any]:
    """``run_dcp``; should DCP ask for a process group after all, again in a 1-rank gloo group."""
    import torch.distributed as dist

    try:
        return run_dcp(args, report, kind, tokens, stager, load)
    except Exception as exc:  # noqa: BLE001
        text = f"{type(exc).__name__}: {exc}"
        if "process group" not in text.lower() or dist.is_initialized():
            raise
    log(f"  DCP asked for a process group ({text}); again in a 1-rank gloo group")
    path = os.path.join(tempfile.mkdtemp(prefix="bench-gpu-pg-", dir=RAM_DISK if os.path.isdir(RAM_DISK) else None), "store")
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    report["process_group"] = {"backend": "gloo", "world_size": 1, "store": path, "why": text}
    res = run_dcp(args, report, kind, tokens, stager, load)
    res["first_error_without_process_group"] = text
    return res


# -- the run -----------------------------------------------------------------------------


def every_k(report: dict[str, Any], kind: str) -> int:
    floors = report.get("floors") or {}
    f = (floors.get("d2h_registered_shm") or {}).get("s") or (floors.get("d2h_pinned") or {}).get("s")
    step = (((report["baseline"].get(kind) or {}).get("stats")) or {}).get("median_s")
    if not f or not step:
        raise RuntimeError("no floor (b)/(a) or baseline median step to derive k from")
    return max(2, math.ceil(f / step))


def free(args: argparse.Namespace) -> None:
    gc.collect()
    if args.dev == "cuda":
        torch.cuda.empty_cache()


def plan(args: argparse.Namespace, report: dict[str, Any]) -> list[tuple[str, str, Callable[[], Any]]]:
    """(name, kind of cost, runner) in the order they run: the most wanted first."""
    tok = {"copy": args.tokens_copy, "compute": args.tokens_compute}
    p: list[tuple[str, str, Callable[[], Any]]] = [("floors", "floors", lambda: run_floors(args, report))]
    for kind in ("copy", "compute"):
        p.append((f"baseline.{kind}", "baseline", lambda kind=kind: run_baseline(args, tok[kind])))
    ten = [(kind, mode) for kind in ("copy", "compute") for mode in ("snapshot", "direct")]
    if not args.features["gpu_snapshot_option"]:  # both modes would be the same run
        ten = [(kind, mode) for kind, mode in ten if mode == "direct"]
        for kind in ("copy", "compute"):
            for every in ("10", "k"):
                report["configs"][config_name("incluster.snapshot", kind, every)] = {
                    "skipped": "this incluster has no gpu_snapshot option"}
    for n, (kind, mode) in enumerate(ten):
        p.append((config_name(f"incluster.{mode}", kind, "10"), "incluster",
                  lambda kind=kind, mode=mode, last=n == len(ten) - 1:
                  run_incluster(args, report, kind, tok[kind], mode, args.every, restore=last)))
    if not args.no_dcp:
        for kind in ("copy", "compute"):
            p.append((config_name("dcp.default", kind, "10"), "dcp",
                      lambda kind=kind: run_dcp_config(args, report, kind, tok[kind], None, load=kind == "compute")))
    for kind, mode in ten:
        p.append((config_name(f"incluster.{mode}", kind, "k"), "incluster",
                  lambda kind=kind, mode=mode: run_every_k(args, report, kind, tok[kind], mode)))
    if args.dcp_kept and not args.no_dcp:
        cuda = args.dev == "cuda"  # pinned, shared, async, non-blocking
        p.append((config_name("dcp.kept", "copy", "10"), "dcp",
                  lambda: run_dcp_config(args, report, "copy", tok["copy"], (cuda, False, True, cuda), load=False)))
    return p


def run_every_k(args: argparse.Namespace, report: dict[str, Any], kind: str, tokens: int, mode: str) -> dict[str, Any]:
    k = min(every_k(report, kind), max(2, args.steps // 2))
    report.setdefault("every_k", {})[kind] = k
    if k == args.every:
        return {"skipped": f"k = {k} is the every-{args.every} schedule"}
    return run_incluster(args, report, kind, tokens, mode, k, restore=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-bench.json", help="JSON results (default gpu-bench.json), rewritten after "
                    "every configuration")
    ap.add_argument("--hidden", type=int, help="Linear width (default 8192; --quick 1024; --cpu-smoke 128)")
    ap.add_argument("--layers", type=int, help="Linear layers (default 6; --quick 4; --cpu-smoke 3)")
    ap.add_argument("--tokens-compute", type=int, help="tokens per step, compute-bound (default 16384; --cpu-smoke 512)")
    ap.add_argument("--tokens-copy", type=int, help="tokens per step, copy-bound (default 2048; --cpu-smoke 32)")
    ap.add_argument("--steps", type=int, help="measured steps per configuration (default 40; --quick/--cpu-smoke 12)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
    ap.add_argument("--every", type=int, default=10, help="the first schedule: save every N steps (default 10)")
    ap.add_argument("--dcp-saves", type=int, help="DCP saves per batch size, every --every steps (default 3; "
                    "--quick/--cpu-smoke 2)")
    ap.add_argument("--restore-repeats", type=int, default=2, help="restores timed (default 2)")
    ap.add_argument("--no-dcp", action="store_true", help="leave DCP out")
    ap.add_argument("--dcp-kept", action=argparse.BooleanOptionalAction, default=True,
                    help="try DCP with a kept DefaultStager last, if time is left (default on)")
    ap.add_argument("--budget-s", type=float, default=230.0, help="skip configurations past this many seconds "
                    "(default 230)")
    ap.add_argument("--quick", action="store_true", help="hidden 1024, 4 layers, 12 steps: a smoke run on a GPU")
    ap.add_argument("--cpu-smoke", action="store_true", help="run the code paths on the CPU with tiny sizes")
    ap.add_argument("--report", metavar="JSON", help="print the table of a saved run and exit")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(render(json.load(f)), flush=True)
        return 0
    preset = ((128, 3, 512, 32, 12, 2) if args.cpu_smoke else (1024, 4, 16384, 2048, 12, 2) if args.quick
              else (8192, 6, 16384, 2048, 40, 3))
    for name, v in zip(("hidden", "layers", "tokens_compute", "tokens_copy", "steps", "dcp_saves"), preset):
        if getattr(args, name) is None:
            setattr(args, name, v)
    if min(args.hidden, args.layers, args.tokens_compute, args.tokens_copy, args.steps, args.every,
           args.dcp_saves, args.restore_repeats) < 1:
        ap.error("sizes, steps, --every, --dcp-saves and --restore-repeats must be positive")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu.py: no CUDA device here; nothing measured (use --cpu-smoke to exercise the script on the CPU)",
              flush=True)
        write_json(args.out, {"skipped": "no CUDA", "torch": torch.__version__})
        return 0
    args.dev = "cpu" if args.cpu_smoke else "cuda"
    args.features = incluster_features()
    info = machine_info()
    if os.path.isdir(RAM_DISK):
        du = shutil.disk_usage(RAM_DISK)
        info.update(ram_disk_size_bytes=du.total, ram_disk_free_bytes=du.free)
    if args.dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    report: dict[str, Any] = {
        "bench": "gpu", "torch": torch.__version__, "device": args.dev, "cpu_smoke": args.cpu_smoke, "machine": info, "incluster": args.features,
        "options": {k: v for k, v in vars(args).items() if k not in ("features", "report")}, "steps": args.steps,
        "state": {"hidden": args.hidden, "layers": args.layers}, "baseline": {}, "configs": {}, "every_k": {},
        "skipped": [], "durations_s": {},
    }
    log(f"gpu bench on {info.get('gpu', 'the CPU (smoke)')}: {args.layers} x Linear({args.hidden}), tokens "
        f"{args.tokens_copy}/{args.tokens_compute}, {args.steps} steps; torch {torch.__version__}; incluster "
        f"{args.features}")
    warnings.filterwarnings("ignore", module="torch.distributed")
    try:
        run_plan(args, report)
    finally:
        pg = report.get("process_group")
        if pg:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            shutil.rmtree(os.path.dirname(pg["store"]), ignore_errors=True)
    report["elapsed_s"] = elapsed()
    write_json(args.out, report)
    print(render(report), flush=True)
    log(f"wrote {args.out}")
    return 0


def run_plan(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Each configuration in turn, within the time budget; the JSON after each."""
    cost: dict[str, float] = {}
    for name, kind, fn in plan(args, report):
        est = cost.get(kind, 0.0)
        if elapsed() + est > args.budget_s:
            msg = f"{name}: {elapsed():.0f} s elapsed + ~{est:.0f} s would pass the {args.budget_s:.0f} s budget"
            report["skipped"].append(msg)
            log(f"SKIP {msg}")
            continue
        log(f"[{elapsed():5.0f} s] {name} ...")
        t0 = time.perf_counter()
        if args.dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
            res = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            log(f"  FAILED: {res['error']}")
        dt = time.perf_counter() - t0
        cost[kind] = max(cost.get(kind, 0.0), dt)
        report["durations_s"][name] = dt
        if args.dev == "cuda":
            res["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        if name == "floors":
            report["floors"] = res
        elif name.startswith("baseline."):
            report["baseline"][name.split(".", 1)[1]] = res
        else:
            report["configs"][name] = res
        free(args)
        report["elapsed_s"] = elapsed()
        write_json(args.out, report)
        sv, lp = res.get("saves_summary") or {}, res.get("loop") or res.get("stats") or {}
        log(f"  done in {dt:.1f} s: step mean {lp.get('mean_s', 0) * 1e3:.1f} ms"
            + (f", inflation {lp['inflation'] * 100:+.1f}%" if lp.get("inflation") is not None else "")
            + (f", staged {sv['staged_median_s'] * 1e3:.1f} ms, durable {sv['durable_median_s'] * 1e3:.1f} ms"
               if sv.get("staged_median_s") is not None and sv.get("durable_median_s") is not None else ""))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
