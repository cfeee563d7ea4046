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
             multiples of floors (b) and (a); durable also from the moment the GPU had
             done the work queued before save() (an event waited on by a thread: a
             compute-bound loop calls save() with most of a step still queued, and no
             checkpoint of that state can start earlier); step inflation against the
             baseline
  restore    (after the last every-10 incluster run, gpu_snapshot=0) a final save waited
             for, the state cloned on the device, the live tensors scrambled, then a new
             Checkpointer ``load``s it (2x; after each, untimed, the slot preparation that
             load() starts in the background is waited for, so it does not run into the
             next restore): seconds, first and best, x floor (c), bitwise check
  dcp        torch.distributed.checkpoint.async_save in its default configuration (no
             stager given; one process, no process group) into /dev/shm, 3 saves every 10
             steps per batch size; its staging is waited for before the optimizer step
             after a save; then ``dcp.load`` of the last save (2x, bitwise check)
  every k    the incluster runs again with a save every k steps,
             k = max(2, ceil(floor (b) / baseline median step)), with keep=3 (a save may
             then start before the previous one is durable)
  many       (copy-bound, every 10, direct then snapshot) the same loop on a state of many
             small tensors: --many-layers x Linear(--many-hidden) with bias + AdamW (default
             400 x 640: 2.0 GB in 2,400 device tensors, 3,200 with AdamW's host-side steps),
             with its own floors (a) and (b) and baseline: the host's work per tensor
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

    python bench/gpu.py                                   # stops starting configurations at --budget-s (230 s)
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
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RAM_DISK, log, machine_info, median, scratch_dir  # noqa: E402 - bench/ is not a package
from gpu_dcp import run_dcp_config  # noqa: E402
from gpu_loop import (WAIT_S, ReadyWatch, build, named_tensors, pinned_floors, run_floors, run_steps,  # noqa: E402
                      same_bits, scramble, shm_floor, sync, warm_up)
from gpu_report import config_name, loop_summary, render, save_summary, step_stats, write_json  # noqa: E402


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def elapsed() -> float:
    return time.perf_counter() - T_START


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
        "gpu_drain_option": "gpu_drain" in inspect.signature(incluster.config.resolve).parameters,
    }


def checkpointer(args: argparse.Namespace, root: str, job: str, mode: str | None, **more: Any) -> Any:
    import incluster

    opts: dict[str, Any] = dict(local_dir=root, job=job, replicas=0, slot_timeout_s=WAIT_S, **more)
    if mode is not None and args.features["gpu_snapshot_option"]:
        opts["gpu_snapshot"] = 0 if mode == "direct" else None
    if mode is not None and args.features.get("gpu_drain_option"):
        opts["gpu_drain"] = "trainer" if mode == "trainer-drain" else "writer"
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
        # Saving every k steps, a save may start before the previous one is durable: a
        # third slot lets it (keep=2 makes it wait for that commit).
        res["keep"] = keep = 2 if every == args.every else 3
        ckpt = checkpointer(args, root, job, mode, keep=keep)
        res["construct_s"] = time.perf_counter() - t0
        try:
            if hasattr(ckpt, "prepare"):
                t0 = time.perf_counter()
                ckpt.prepare(state).result(WAIT_S)
                res["prepare_s"] = time.perf_counter() - t0
            res["gpu_snapshot_active_after_prepare"] = getattr(ckpt, "gpu_snapshot_active", None)
            if mode == "snapshot" and args.dev == "cuda" and hasattr(ckpt, "gpu_drain_in_writer"):
                t0 = time.perf_counter()  # the writer opens the shared buffer in the background
                while not ckpt.gpu_drain_in_writer and time.perf_counter() - t0 < 60:
                    time.sleep(0.05)
                res["writer_open_s"] = time.perf_counter() - t0
                res["gpu_drain_in_writer"] = ckpt.gpu_drain_in_writer
            handles: list[tuple[int, Any]] = []
            times: list[float] = []
            watch = ReadyWatch(args)

            def save(i: int) -> None:
                watch.mark(i)
                handles.append((i, ckpt.save(args.warmup + i, state)))

            try:  # a failing save keeps the saves and steps before it
                run_steps(args, model, optim, x, args.steps, set(range(0, args.steps, every)), save, times=times)
                t0 = time.perf_counter()
                ckpt.wait(WAIT_S)
                res["wait_end_s"] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001
                res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                log(f"  FAILED at step {len(times)}: {type(exc).__name__}: {exc}")
                restore = False
            res["gpu_snapshot_active"] = getattr(ckpt, "gpu_snapshot_active", None)
            res["steps_s"] = times
            ready = watch.close()
            res["saves"] = [{"i": i, "step": h.step, "ready_s": ready.get(i), "blocked_s": h.blocked_s,
                             "staged_s": h.staged_s, "drained_s": getattr(h, "drained_s", None),
                             "committed_s": getattr(h, "committed_s", None), "durable_s": h.durable_s,
                             "durable_after_ready_s": _minus(h.durable_s, ready.get(i))} for i, h in handles]
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
            try:
                ckpt.close()
            except Exception as exc:  # noqa: BLE001 - an error already raised by wait() comes again
                res["close_error"] = f"{type(exc).__name__}: {exc}"
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
            if hasattr(ckpt2, "prepare"):  # load() readies the slots in the background: not into the next restore
                ckpt2.prepare(state).result(WAIT_S)
            rep = getattr(ckpt2, "last_restore", None)
            runs.append({"s": dt, "step": step, "bitwise": ok, "mismatches": bad,
                         "line": rep.line() if rep is not None and hasattr(rep, "line") else None})
            log(f"  restore: {dt * 1e3:.0f} ms, step {step}, bitwise {ok}")
        try:  # the first save after a restore (its slots prepared)
            h = ckpt2.save(final_step + 1, state)
            h.wait(WAIT_S)
            out["save_after_load"] = {"blocked_s": h.blocked_s, "staged_s": h.staged_s, "durable_s": h.durable_s}
            log(f"  first save after the restore: blocked {h.blocked_s * 1e3:.1f} ms, staged "
                f"{h.staged_s * 1e3:.1f} ms, durable {h.durable_s * 1e3:.1f} ms")
        except Exception as exc:  # noqa: BLE001 - keep the restores' numbers
            out["save_after_load"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ckpt2.close()
    secs = [r["s"] for r in runs]
    out.update(runs=runs, seconds=secs, min_s=min(secs), median_s=median(secs),
               bitwise=all(r["bitwise"] and r["step"] == final_step for r in runs), line=runs[-1]["line"])
    return out


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
    p: list[tuple[str, str, Callable[[], Any]]] = [("floors", "floors", partial(run_floors, args, report))]
    for kind in ("copy", "compute"):
        p.append((f"baseline.{kind}", "baseline", partial(run_baseline, args, tok[kind])))
    ten = [(kind, mode) for kind in ("copy", "compute") for mode in ("snapshot", "direct")]
    if args.features.get("gpu_drain_option"):  # the drain in the trainer, for comparison
        ten.insert(1, ("copy", "trainer-drain"))
    if not args.features["gpu_snapshot_option"]:  # both modes would be the same run
        ten = [(kind, mode) for kind, mode in ten if mode == "direct"]
        for kind in ("copy", "compute"):
            for every in ("10", "k"):
                report["configs"][config_name("incluster.snapshot", kind, every)] = {
                    "skipped": "this incluster has no gpu_snapshot option"}
    for n, (kind, mode) in enumerate(ten):
        p.append((config_name(f"incluster.{mode}", kind, "10"), "incluster",
                  partial(run_incluster, args, report, kind, tok[kind], mode, args.every, n == len(ten) - 1)))
    if args.variants and args.features["gpu_snapshot_option"]:
        for vname, env in VARIANTS:
            p.append((config_name(f"incluster.snapshot+{vname}", "copy", "10"), "incluster",
                      partial(run_variant, args, report, env)))
    if not args.no_dcp:
        for kind in ("copy", "compute"):
            p.append((config_name("dcp.default", kind, "10"), "dcp",
                      partial(run_dcp_config, args, report, kind, tok[kind], None, kind == "compute")))
    for kind, mode in sorted(ten, key=lambda km: km[1] != "snapshot"):  # the default first
        p.append((config_name(f"incluster.{mode}", kind, "k"), "incluster",
                  partial(run_every_k, args, report, kind, tok[kind], mode)))
    if args.many_layers > 0:
        for mode in ("direct", "snapshot") if args.features["gpu_snapshot_option"] else ("direct",):
            p.append((config_name(f"incluster.{mode}", "many", "10"), "incluster", partial(run_many, args, report, mode)))
    if args.dcp_kept and not args.no_dcp:
        cuda = args.dev == "cuda"  # pinned, shared, async, non-blocking
        p.append((config_name("dcp.kept", "copy", "10"), "dcp",
                  partial(run_dcp_config, args, report, "copy", tok["copy"], (cuda, False, True, cuda), False)))
    return p


# The default (snapshot, writer drains) with one tuning variable changed, copy-bound, every
# 10: the writer's hashing threads (durable against the loop's inflation) and the drain's
# pieces (a smaller piece: a shorter wait for whatever else the GPU copies meanwhile).
VARIANTS = [
    ("hash8", {"INCLUSTER_HASH_THREADS": "8"}),  # the default is min(16, the rank's cores)
    ("hash4", {"INCLUSTER_HASH_THREADS": "4"}),
    ("piece4w4", {"INCLUSTER_DRAIN_PIECE_MIB": "4", "INCLUSTER_DRAIN_WINDOW": "4"}),
]


def run_variant(args: argparse.Namespace, report: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """The writer process starts with ``env`` (it reads the variables when it starts)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        res = run_incluster(args, report, "copy", args.tokens_copy, "snapshot", args.every, restore=False)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res["env"] = env
    return res


def many_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "hidden": args.many_hidden, "layers": args.many_layers, "bias": True})


def many_setup(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    """Floors (a), (b) and the baseline of the many-tensor state, measured once."""
    if "many" in report:
        return report["many"]
    margs = many_args(args)
    model, optim, x = build(margs, args.tokens_copy)
    warm_up(margs, model, optim, x)
    named = named_tensors(model, optim)
    ts = [t for _, t in named if t.device.type == args.dev]
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    floors: dict[str, Any] = {"bytes": nbytes, "tensors": len(named), "device_tensors": len(ts)}
    with torch.no_grad():
        pinned_floors(margs, ts, nbytes, floors)
        floors["d2h_registered_shm"] = shm_floor(margs, ts, nbytes)
    del model, optim, x, named, ts
    free(args)
    report["many"] = {"hidden": margs.hidden, "layers": margs.layers, "floors": floors,
                      "baseline": run_baseline(margs, args.tokens_copy)}
    return report["many"]


def run_many(args: argparse.Namespace, report: dict[str, Any], mode: str) -> dict[str, Any]:
    """The copy-bound loop on a state of many small tensors (--many-layers x
    Linear(--many-hidden) with bias, AdamW): the host's work per tensor before and between
    the copies, against this state's own floors (a) and (b) and baseline."""
    m = many_setup(args, report)
    sub = {"floors": m["floors"], "baseline": {"many": m["baseline"]}}
    return run_incluster(many_args(args), sub, "many", args.tokens_copy, mode, args.every, restore=False)


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
    ap.add_argument("--many-layers", type=int, help="layers of the many-tensor state (default 400, 3,200 tensors "
                    "with AdamW; --quick 100; --cpu-smoke 20; 0 leaves it out)")
    ap.add_argument("--many-hidden", type=int, help="its Linear width (default 640; --quick 256; --cpu-smoke 32)")
    ap.add_argument("--steps", type=int, help="measured steps per configuration (default 40; --quick/--cpu-smoke 12)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
    ap.add_argument("--every", type=int, default=10, help="the first schedule: save every N steps (default 10)")
    ap.add_argument("--dcp-saves", type=int, help="DCP saves per batch size, every --every steps (default 3; "
                    "--quick/--cpu-smoke 2)")
    ap.add_argument("--restore-repeats", type=int, default=2, help="restores timed (default 2)")
    ap.add_argument("--no-dcp", action="store_true", help="leave DCP out")
    ap.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                    help="the default run again with one tuning variable changed (INCLUSTER_HASH_THREADS, "
                    "INCLUSTER_DRAIN_PIECE_MIB/WINDOW), copy-bound, every 10 (default on)")
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
    preset = ((128, 3, 512, 32, 12, 2, 20, 32) if args.cpu_smoke else (1024, 4, 16384, 2048, 12, 2, 100, 256)
              if args.quick else (8192, 6, 16384, 2048, 40, 3, 400, 640))
    for name, v in zip(("hidden", "layers", "tokens_compute", "tokens_copy", "steps", "dcp_saves", "many_layers",
                        "many_hidden"), preset):
        if getattr(args, name) is None:
            setattr(args, name, v)
    if min(args.hidden, args.layers, args.tokens_compute, args.tokens_copy, args.steps, args.every,
           args.dcp_saves, args.restore_repeats, args.many_hidden) < 1 or args.many_layers < 0:
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


def store(report: dict[str, Any], name: str, res: dict[str, Any]) -> None:
    if name == "floors":
        report["floors"] = res
    elif name.startswith("baseline."):
        report["baseline"][name.split(".", 1)[1]] = res
    else:
        report["configs"][name] = res


def run_plan(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Each configuration in turn, within the time budget; the JSON after each."""
    cost: dict[str, float] = {}
    for name, kind, fn in plan(args, report):
        est = cost.get(kind, 0.0)
        if elapsed() + est > args.budget_s:
            msg = f"{name}: {elapsed():.0f} s elapsed + ~{est:.0f} s would pass the {args.budget_s:.0f} s budget"
            report["skipped"].append(msg)
            log(f"SKIP {msg}")
            store(report, name, {"skipped": "time budget"})
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
        store(report, name, res)
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
