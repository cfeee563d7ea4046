"""How long does a checkpoint cost the trainer? incluster against torch.save and DCP.

One process, CPU, one run. For each state size (default 512 MiB and 2 GiB) and each
shape ("many": 2,000 tensors, "few": 8 tensors) it measures, on the same state:

  incluster              save() return, staged (state may change), durable (checksummed,
                         committed in the RAM disk)
  torch.save             to a file in /dev/shm (blocking = durable)
  dcp.save               to a folder in /dev/shm (blocking = durable); with DCP's default
                         writer, and with a 2-thread writer without fsync
  dcp.async_save         default: a new staging buffer every call, staged on the caller's
                         thread (staged = return); kept stager: one
                         DefaultStager(StagingOptions(False, False, True, False)) reused
                         across calls (cached buffers, staging on a thread), with the
                         default writer and with the 2-thread writer
  floor                  one copy_ of the same bytes between two contiguous tensors that
                         were allocated and touched beforehand; for reference also a loop
                         of one copy_ per tensor into views of one reused buffer, on the
                         main thread and on a worker thread (where checkpointers stage)

"Best DCP" is whichever DCP configuration has the lowest median for the column at hand.
Every system saves ``1 + repeats`` times with increasing steps; the first save is
warm-up and left out of the medians (incluster's is shown on its own row, since it
allocates its slot files then). Between saves a few values change (like a training
step) and each save is waited for until durable, so every save is measured alone;
"worst" is the slowest save() return among the measured saves. Each system writes into
a fresh folder under /dev/shm that is deleted afterwards, before the next system runs.

Timings on a small shared machine are noisy: the 1-minute load average is printed with
every table (and stored in the JSON); compare runs made at load below the core count.

    python bench/save_overhead.py                     # 512M,2G; a few minutes
    python bench/save_overhead.py --quick             # small sizes, a smoke run
    python bench/save_overhead.py --sizes 1G --repeats 7 --json out.json
    # plain tensors no optimizer steps, which save() itself copies (opt-in systems):
    python bench/save_overhead.py --sizes 256M --shapes few \
        --systems incluster.plain,incluster.plain.prep,dcp.async,dcp.async.kept
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402 - bench/ is not a package
    floor_copy,
    human_size,
    loadavg,
    log,
    loop_copy,
    machine_info,
    markdown_table,
    median,
    ms,
    mutate,
    make_state,
    parse_size,
    ratio,
    rss_bytes,
    scratch_dir,
    state_bytes,
)

WAIT_S = 900.0  # longest wait for one save to finish before the run is declared stuck

# The targets (issue 2, deliverable 7), as fractions / multiples of the floor.
BLOCK_FRACTION = 0.05
STAGED_MAX = 1.3
DURABLE_MAX = 2.0
DCP_SPEEDUP_MIN = 3.0


@dataclass
class Sample:
    blocked: float
    staged: float | None
    durable: float | None


@dataclass
class Result:
    system: str
    note: str
    samples: list[Sample] = field(default_factory=list)  # samples[0] is the warm-up save
    error: str | None = None
    is_dcp: bool = False
    load_before: float | None = None  # 1-minute load average when this system started

    def worst(self, key: str) -> float | None:
        vals = [getattr(s, key) for s in self.measured() if getattr(s, key) is not None]
        return max(vals) if vals else None

    def measured(self) -> list[Sample]:
        return self.samples[1:]

    def med(self, key: str) -> float | None:
        return median([getattr(s, key) for s in self.measured()])

    def first(self, key: str) -> float | None:
        return getattr(self.samples[0], key) if self.samples else None


class _Stamp:
    """Records when a future completes, from the thread that completes it."""

    def __init__(self, fut: Any) -> None:
        self.t: float | None = None
        self._ev = threading.Event()
        fut.add_done_callback(self._done)

    def _done(self, _: Any) -> None:
        self.t = time.perf_counter()
        self._ev.set()

    def wait(self) -> float:
        if not self._ev.wait(WAIT_S):
            raise TimeoutError(f"a save did not finish within {WAIT_S:.0f} s")
        assert self.t is not None
        return self.t


# -- systems -----------------------------------------------------------------------------
# Each runner saves ``state`` (1 + repeats) times under ``root`` and returns the samples;
# ``gap`` seconds of idle time separate consecutive saves (0 = back to back).


INCLUSTER_OPTIONS: dict[str, Any] = {}  # extra Checkpointer options from the command line


def run_incluster(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    import incluster

    samples = []
    # As in training, the state changes only in optimizer steps: the tensors are an
    # optimizer's parameters (sharing their storage), stepped before each change, so the
    # step pre-hook orders the change after the save's copy and save() need not clone
    # them. (Plain tensors changed outside an optimizer are cloned in save(), up to 256
    # MiB: a different, documented cost, not what this bench compares.)
    params = [torch.nn.Parameter(t, requires_grad=False) for t in state.values()]
    optim = torch.optim.SGD(params, lr=0.0)
    ckpt = incluster.Checkpointer(local_dir=root, job="bench", keep=2, **INCLUSTER_OPTIONS)
    try:
        for step in range(1 + repeats):
            optim.step()  # waits (pre-hook) until the previous save's copy is done
            mutate(state, step)
            t0 = time.perf_counter()
            h = ckpt.save(step, state)
            t1 = time.perf_counter()
            h.wait(WAIT_S)
            off = h.started - t0  # the handle's clock starts inside save()
            samples.append(
                Sample(
                    blocked=t1 - t0,
                    staged=off + h.staged_s if h.staged_s is not None else None,
                    durable=off + h.durable_s if h.durable_s is not None else None,
                )
            )
            time.sleep(gap)
    finally:
        ckpt.close()
    return samples


def run_incluster_plain(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float,
                        prepare: bool = False) -> list[Sample]:
    """The state as plain tensors no optimizer steps (EMA weights, say): save() copies
    them itself (up to 256 MiB) into memory reused from save to save; ``prepare``: made
    ahead by ckpt.prepare(state), so even the first save only copies."""
    import incluster

    samples = []
    ckpt = incluster.Checkpointer(local_dir=root, job="bench", keep=2, **INCLUSTER_OPTIONS)
    try:
        if prepare:
            ckpt.prepare(state).result(WAIT_S)
        for step in range(1 + repeats):
            mutate(state, step)
            t0 = time.perf_counter()
            h = ckpt.save(step, state)
            t1 = time.perf_counter()
            h.wait(WAIT_S)
            off = h.started - t0
            samples.append(Sample(blocked=t1 - t0, staged=off + (h.staged_s or 0.0), durable=off + (h.durable_s or 0.0)))
            time.sleep(gap)
    finally:
        ckpt.close()
    return samples


def run_incluster_plain_prepared(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    return run_incluster_plain(state, root, repeats, gap, prepare=True)


def run_torch_save(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    samples, prev = [], None
    for step in range(1 + repeats):
        mutate(state, step)
        path = os.path.join(root, f"step-{step}.pt")
        t0 = time.perf_counter()
        torch.save(state, path)
        dt = time.perf_counter() - t0
        samples.append(Sample(blocked=dt, staged=dt, durable=dt))
        if prev is not None:  # keep the newest file only, like a rolling checkpoint
            os.unlink(prev)
        prev = path
        time.sleep(gap)
    return samples


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _writer(path: str, threads: int) -> Any:
    """None = DCP's defaults (one writer thread, fsync); else ``threads`` writer threads
    and no fsync (a RAM disk has nothing to sync)."""
    if threads <= 0:
        return None
    return _dcp().FileSystemWriter(path, thread_count=threads, sync_files=False)


def _run_dcp_save(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float, threads: int) -> list[Sample]:
    dcp = _dcp()
    samples, prev = [], None
    for step in range(1 + repeats):
        mutate(state, step)
        path = os.path.join(root, f"step-{step}")
        writer = _writer(path, threads)
        t0 = time.perf_counter()
        if writer is None:
            dcp.save(state, checkpoint_id=path)
        else:
            dcp.save(state, storage_writer=writer)
        dt = time.perf_counter() - t0
        samples.append(Sample(blocked=dt, staged=dt, durable=dt))
        if prev is not None:
            shutil.rmtree(prev, ignore_errors=True)
        prev = path
        time.sleep(gap)
    return samples


def run_dcp_save(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    return _run_dcp_save(state, root, repeats, gap, threads=0)


def run_dcp_save_t2(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    return _run_dcp_save(state, root, repeats, gap, threads=2)


def _run_async(
    state: dict[str, torch.Tensor], root: str, repeats: int, gap: float, stager: Any | None, threads: int = 0
) -> list[Sample]:
    dcp = _dcp()
    samples, prev = [], None
    for step in range(1 + repeats):
        mutate(state, step)
        path = os.path.join(root, f"step-{step}")
        writer = _writer(path, threads)
        kwargs: dict[str, Any] = {"checkpoint_id": path} if writer is None else {"storage_writer": writer}
        if stager is not None:
            kwargs["async_stager"] = stager
        t0 = time.perf_counter()
        resp = dcp.async_save(state, **kwargs)
        t1 = time.perf_counter()
        if hasattr(resp, "upload_completion"):  # AsyncSaveResponse: staging on a thread
            staged_stamp: _Stamp | None = getattr(stager, "stamp", None) or _Stamp(resp.staging_completion)
            durable_stamp = _Stamp(resp.upload_completion)
            upload = resp.upload_completion
        else:  # a plain Future: staging happened inside the call
            staged_stamp = None
            durable_stamp = _Stamp(resp)
            upload = resp
        upload.result(WAIT_S)
        t_durable = durable_stamp.wait()
        t_staged = staged_stamp.wait() if staged_stamp is not None else t1
        samples.append(Sample(blocked=t1 - t0, staged=t_staged - t0, durable=t_durable - t0))
        if prev is not None:
            shutil.rmtree(prev, ignore_errors=True)
        prev = path
        time.sleep(gap)
    return samples


def run_dcp_async_default(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    return _run_async(state, root, repeats, gap, stager=None)


def _run_dcp_async_kept(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float, threads: int) -> list[Sample]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # (pinned memory, shared memory, async staging, non-blocking copy): the last needs an
    # accelerator and the first two only help with one, so async staging alone on CPU.
    # (BlockingAsyncStager(cache_staged_state_dict=True), the other kept stager, pins its
    # cache and so cannot run without an accelerator in torch 2.13.)
    class TimedStager(DefaultStager):
        """Stamps the end of staging on the staging future itself, before async_save
        returns it (a callback added after the return would be late for small states)."""

        stamp: _Stamp | None = None

        def stage(self, state_dict: Any, **kwargs: Any) -> Any:
            out = super().stage(state_dict, **kwargs)
            self.stamp = _Stamp(out) if isinstance(out, Future) else None
            return out

    stager = TimedStager(StagingOptions(False, False, True, False))
    try:
        return _run_async(state, root, repeats, gap, stager=stager, threads=threads)
    finally:
        stager.close()


def run_dcp_async_kept(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    return _run_dcp_async_kept(state, root, repeats, gap, threads=0)


def run_dcp_async_kept_t2(state: dict[str, torch.Tensor], root: str, repeats: int, gap: float) -> list[Sample]:
    return _run_dcp_async_kept(state, root, repeats, gap, threads=2)


Runner = Callable[[dict[str, torch.Tensor], str, int, float], list[Sample]]
SYSTEMS: dict[str, tuple[Runner, str, bool]] = {
    # key: (runner, description, is a DCP configuration)
    "incluster": (run_incluster, "incluster Checkpointer, keep=2", False),
    "incluster.plain": (run_incluster_plain, "incluster, plain tensors no optimizer steps (copied in save())", False),
    "incluster.plain.prep": (run_incluster_plain_prepared, "incluster, the same after ckpt.prepare(state)", False),
    "torch.save": (run_torch_save, "torch.save to /dev/shm", False),
    "dcp.save": (run_dcp_save, "dcp.save, default writer", True),
    "dcp.save.t2": (run_dcp_save_t2, "dcp.save, writer 2 threads no fsync", True),
    "dcp.async": (run_dcp_async_default, "dcp.async_save, default stager", True),
    "dcp.async.kept": (run_dcp_async_kept, "dcp.async_save, kept DefaultStager(F,F,T,F)", True),
    "dcp.async.kept.t2": (
        run_dcp_async_kept_t2,
        "dcp.async_save, kept DefaultStager(F,F,T,F), writer 2 threads no fsync",
        True,
    ),
}
DEFAULT_SYSTEMS = [k for k in SYSTEMS if not k.startswith("incluster.plain")]  # opt-in: --systems


# -- the run -----------------------------------------------------------------------------


@dataclass
class Floors:
    one: float  # one copy_ of all the bytes (THE floor the targets refer to)
    one_samples: list[float]
    loop_main: float | None = None  # one copy_ per tensor, main thread
    loop_thread: float | None = None  # the same loop on a worker thread


def run_config(
    size: int, shape: str, n_tensors: int, systems: list[str], repeats: int, gap: float
) -> tuple[Floors, list[Result]]:
    tag = f"[{human_size(size)} / {shape}]"
    log(f"{tag} floor: one copy_ into reused memory ...")
    one = floor_copy(size, max(9, repeats))
    floors = Floors(one=median(one) or 0.0, one_samples=one)
    log(f"  {ms(floors.one)} ms ({size / floors.one / 1e9:.1f} GB/s); building a state of {n_tensors} tensors ...")
    state = make_state(size, n_tensors)
    nbytes = state_bytes(state)
    results = []
    try:
        floors.loop_main = median(loop_copy(state, max(5, repeats)))
        floors.loop_thread = median(loop_copy(state, max(5, repeats), background=True))
        log(f"  copy_ loop per tensor: main thread {ms(floors.loop_main)} ms, worker thread {ms(floors.loop_thread)} ms")
        for key in systems:
            runner, note, is_dcp = SYSTEMS[key]
            res = Result(system=key, note=note, is_dcp=is_dcp, load_before=loadavg())
            log(f"{tag} {key}: {1 + repeats} saves of {human_size(nbytes)} (load {res.load_before}) ...")
            t_start = time.perf_counter()
            try:
                with scratch_dir(f"bench-{key}-") as root:
                    res.samples = runner(state, root, repeats, gap)
            except Exception as exc:  # noqa: BLE001 - one failing system must not end the run
                res.error = f"{type(exc).__name__}: {exc}"
                log(f"  FAILED: {res.error}\n{traceback.format_exc()}")
            gc.collect()
            log(
                f"  done in {time.perf_counter() - t_start:.1f} s; medians blocked {ms(res.med('blocked'))} ms, "
                f"staged {ms(res.med('staged'))} ms, durable {ms(res.med('durable'))} ms; "
                f"rss {((rss_bytes() or 0) / 2**30):.1f} GiB"
            )
            results.append(res)
    finally:
        del state
        gc.collect()
    return floors, results


def best_dcp(results: list[Result], key: str) -> Result | None:
    cands = [r for r in results if r.is_dcp and r.error is None and r.med(key) is not None]
    return min(cands, key=lambda r: r.med(key)) if cands else None  # type: ignore[arg-type, return-value]


def targets_for(results: list[Result], floor: float) -> list[dict[str, Any]]:
    inc = next((r for r in results if r.system == "incluster" and r.error is None and r.samples), None)
    if inc is None:
        return []
    b, s, d = inc.med("blocked"), inc.med("staged"), inc.med("durable")
    bb, bd = best_dcp(results, "blocked"), best_dcp(results, "durable")
    out = [
        {"target": f"save() returns in < {BLOCK_FRACTION:.0%} of the floor", "value": b,
         "limit": BLOCK_FRACTION * floor, "met": b is not None and b < BLOCK_FRACTION * floor},
    ]
    if bb is not None:
        lim = bb.med("blocked")
        out.append({"target": f"save() returns no later than best DCP ({bb.system})", "value": b,
                    "limit": lim, "met": b is not None and lim is not None and b <= lim})
    out.append({"target": f"staged within {STAGED_MAX}x the floor", "value": s, "limit": STAGED_MAX * floor,
                "met": s is not None and s <= STAGED_MAX * floor})
    out.append({"target": f"durable within {DURABLE_MAX}x the floor", "value": d, "limit": DURABLE_MAX * floor,
                "met": d is not None and d <= DURABLE_MAX * floor})
    if bd is not None:
        lim = bd.med("durable")
        out.append({"target": f"durable >= {DCP_SPEEDUP_MIN:g}x sooner than best DCP ({bd.system})", "value": d,
                    "limit": lim / DCP_SPEEDUP_MIN if lim is not None else None,
                    "met": d is not None and lim is not None and d * DCP_SPEEDUP_MIN <= lim})
    return out


def print_config(size: int, shape: str, n_tensors: int, floors: Floors, results: list[Result], repeats: int) -> None:
    floor = floors.one
    bd = best_dcp(results, "durable")
    bd_t = bd.med("durable") if bd is not None else None
    headers = ["system", "save() blocks", "worst", "staged", "durable", "blocked/floor", "staged/floor",
               "durable/floor", "durable vs best DCP"]
    rows = [["floor: one copy_ into reused memory", ms(floor), "", ms(floor), ms(floor), "1.00x", "1.00x", "1.00x", "—"]]
    for label, t in (("(copy_ loop per tensor, main thread)", floors.loop_main),
                     ("(copy_ loop per tensor, worker thread)", floors.loop_thread)):
        if t is not None:
            rows.append([label, "", "", ms(t), "", "", ratio(t, floor), "", ""])
    for r in results:
        if r.error is not None:
            rows.append([r.note, "FAILED", "", r.error[:60], "", "", "", "", ""])
            continue
        b, s, d = r.med("blocked"), r.med("staged"), r.med("durable")
        rows.append([r.note, ms(b), ms(r.worst("blocked")), ms(s), ms(d), ratio(b, floor), ratio(s, floor),
                     ratio(d, floor), ratio(d, bd_t)])
        if r.system.startswith("incluster") and r.samples:
            fb, fs, fd = r.first("blocked"), r.first("staged"), r.first("durable")
            rows.append([f"  {r.system}, first save (allocates slot)", ms(fb), "", ms(fs), ms(fd), ratio(fb, floor),
                         ratio(fs, floor), ratio(fd, floor), ratio(fd, bd_t)])
    loads = [r.load_before for r in results if r.load_before is not None]
    print()
    print(f"### {human_size(size)}, {shape} ({n_tensors} tensors): medians of {repeats} saves (worst: slowest "
          f"save() return), ms; load average {min(loads, default=0):.2f}-{max(loads, default=0):.2f}")
    print()
    print(markdown_table(headers, rows, right=[False] + [True] * (len(headers) - 1)))
    tg = targets_for(results, floor)
    if tg:
        print()
        print(markdown_table(
            ["target (issue 2)", "incluster", "limit", "met"],
            [[t["target"], ms(t["value"]), ms(t["limit"]), "yes" if t["met"] else "NO"] for t in tg],
            right=[False, True, True, False],
        ))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma-separated state sizes (default 512M,2G; --quick: 16M,64M)")
    ap.add_argument("--repeats", type=int, default=None, help="measured saves per system, after one warm-up (default 5; --quick: 3)")
    ap.add_argument("--many", type=int, default=2000, help="tensors in the 'many' shape (default 2000)")
    ap.add_argument("--few", type=int, default=8, help="tensors in the 'few' shape (default 8)")
    ap.add_argument("--shapes", default="many,few", help="which shapes to run (default many,few)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help=f"comma-separated, from {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    ap.add_argument("--gap", type=float, default=0.0,
                    help="idle seconds between a save becoming durable and the next save (default 0)")
    ap.add_argument("--writer", choices=["process", "thread"], default=None,
                    help="incluster's commit writer (default: the library's default)")
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats: a smoke run")
    ap.add_argument("--json", metavar="OUT", help="also write every sample and median as JSON to OUT")
    args = ap.parse_args(argv)

    sizes = [parse_size(s) for s in (args.sizes or ("16M,64M" if args.quick else "512M,2G")).split(",") if s]
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if repeats < 1:
        ap.error("--repeats must be at least 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    shape_n = {"many": args.many, "few": args.few}
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if any(s not in shape_n for s in shapes):
        ap.error("--shapes takes many and/or few")

    if args.writer:
        INCLUSTER_OPTIONS["writer"] = args.writer
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")
    info = machine_info()
    import incluster

    info["incluster"] = os.path.dirname(os.path.abspath(incluster.__file__))
    info["incluster_options"] = dict(INCLUSTER_OPTIONS)
    print(f"# save overhead: incluster from {info['incluster']}, torch {info['torch']}, python {info['python']}, {info['cpus']} CPUs "
          f"({info['torch_threads']} torch threads), RAM {info.get('ram_bytes', 0) / 2**30:.1f} GiB, "
          f"{repeats} measured saves + 1 warm-up per system, gap {args.gap:g} s"
          + (f", incluster options {INCLUSTER_OPTIONS}" if INCLUSTER_OPTIONS else ""))
    report: dict[str, Any] = {"machine": info, "repeats": repeats, "gap_s": args.gap, "configs": []}
    all_ok = True
    for size in sizes:
        for shape in shapes:
            n = shape_n[shape]
            floors, results = run_config(size, shape, n, systems, repeats, args.gap)
            print_config(size, shape, n, floors, results, repeats)
            tg = targets_for(results, floors.one)
            all_ok &= bool(tg) and all(t["met"] for t in tg)
            report["configs"].append({
                "size_bytes": size,
                "shape": shape,
                "tensors": n,
                "floor_s": floors.one,
                "floor_samples_s": floors.one_samples,
                "loop_copy_main_thread_s": floors.loop_main,
                "loop_copy_worker_thread_s": floors.loop_thread,
                "results": [
                    {
                        "system": r.system,
                        "note": r.note,
                        "is_dcp": r.is_dcp,
                        "error": r.error,
                        "load_before": r.load_before,
                        "warmup": asdict(r.samples[0]) if r.samples else None,
                        "samples": [asdict(s) for s in r.measured()],
                        "median": {k: r.med(k) for k in ("blocked", "staged", "durable")},
                        "worst": {k: r.worst(k) for k in ("blocked", "staged", "durable")},
                    }
                    for r in results
                ],
                "targets": tg,
            })
    print()
    print(f"all incluster targets met: {'yes' if all_ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
