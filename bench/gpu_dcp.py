"""The DCP configurations of bench/gpu.py (see its docstring): dcp.async_save in a training loop, then dcp.load."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RAM_DISK, log, median, scratch_dir  # noqa: E402 - bench/ is not a package
from gpu_loop import WAIT_S, build, named_tensors, run_steps, same_bits, scramble, sync, warm_up  # noqa: E402
from gpu_report import loop_summary, save_summary  # noqa: E402


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
        resp: Any = dcp.async_save(sd, **kw)
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
        times: list[float] = []
        try:  # a failing save (DCP's kept stager may) keeps the saves and steps before it
            run_steps(args, model, optim, x, steps, set(range(0, steps, every)),
                      lambda i: run.save(args.warmup + i, model, optim), run.wait_staged, after, times)
            res["close_s"] = run.close()
        except Exception as exc:  # noqa: BLE001
            res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            log(f"  FAILED at step {len(times)}: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                run.close()
            load = False
        res["saves"] = run.records
        res["steps_s"] = times
        errs = [r["error"] for r in run.records if r.get("error")]
        if errs and not res.get("error"):
            res["error"] = errs[0]
        res["saves_summary"] = save_summary(run.records, report.get("floors") or {})
        base = ((report["baseline"].get(kind) or {}).get("stats") or {}).get("mean_s")
        res["loop"] = loop_summary(times, [i for i in range(0, len(times), every)], base)
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

