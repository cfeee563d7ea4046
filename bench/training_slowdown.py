"""How much does checkpointing slow down data-parallel training? incluster against DCP.

A CPU training loop on 2 ranks (``--ranks 1``: one; gloo, ``DistributedDataParallel``: gradients are
all-reduced every step, so the ranks are coupled like real data-parallel training), a
stack of ``Linear`` layers trained with AdamW; the model + optimizer state is about
``--state-mib`` per rank. Every step is timed (the saving steps included) under each
configuration, each run as a fresh 2-rank job in the same session:

  none                no checkpointing (run first and again last, to show drift)
  incluster.process   incluster.Checkpointer(writer="process", keep=2), save every k steps
  incluster.thread    the same with writer="thread"
  dcp.thread          torch.distributed.checkpoint.async_save, thread executor (default)
  dcp.process         async_save with AsyncCheckpointerType.PROCESS

DCP gets the best configuration found (DESIGN §1): a ``DefaultStager`` kept across saves
(its staging buffers are cached, staging runs on its own thread), a ``FileSystemWriter``
without fsync (the target is a RAM disk), a separate gloo group for its collectives (so
they never interleave with DDP's all-reduces), the previous save waited for before the
next ``async_save`` (DCP requires it) and old checkpoint folders deleted on a background
thread. The thread executor uses ``StagingOptions(False, False, True, False)`` (async
staging only); the process executor ``StagingOptions(False, True, True, False)``: staging
straight into shared memory, so handing the staged tensors to the checkpoint process
passes file descriptors instead of copying every byte again. Before ``optimizer.step()``
the loop waits for DCP's staging to finish (incluster's optimizer pre-step hook does the
same by itself), so both save a consistent state.

Saves happen right after the optimizer step of measured steps 0, k, 2k, ...; the first
save pays one-time costs (slot files, staging buffers, DCP's checkpoint process), so
the table shows the mean over all measured steps and a "steady" mean from the second
save on. Each configuration writes into a fresh folder under /dev/shm that is deleted
afterwards, whatever happens.

    python bench/training_slowdown.py                    # 512 MiB/rank, several minutes
    python bench/training_slowdown.py --quick            # small state, a smoke run
    python bench/training_slowdown.py --state-mib 768 --steps 60 --every 10 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RAM_DISK, loadavg, log, machine_info  # noqa: E402 - bench/ is not a package
from training_slowdown_memory import MemWatch  # noqa: E402
from training_slowdown_ranks import worker  # noqa: E402
from training_slowdown_report import combine, fmt_ms, print_tables, summarize  # noqa: E402

CONFIGS: dict[str, str] = {
    "none": "no checkpointing",
    "incluster.process": 'incluster, writer="process", keep=2',
    "incluster.thread": 'incluster, writer="thread", keep=2',
    "dcp.thread": "dcp.async_save, thread executor, kept DefaultStager(F,F,T,F)",
    "dcp.process": "dcp.async_save, process executor, kept DefaultStager(F,T,T,F)",
    # Not run by default; for checking that the choice above is DCP's best.
    "dcp.thread.default": "dcp.async_save, thread executor, default stager",
    "dcp.process.default": "dcp.async_save, process executor, default stager",
}
DEFAULT_CONFIGS = ["none", "incluster.process", "incluster.thread", "dcp.thread", "dcp.process"]
JOB_TIMEOUT_S = 3600.0


def run_config(kind: str, args: argparse.Namespace, passthrough: list[str]) -> dict[str, Any]:
    from incluster.testing.launch import launch

    base = tempfile.mkdtemp(prefix=f"bench-slowdown-{kind}-", dir=RAM_DISK if os.path.isdir(RAM_DISK) else None)
    res: dict[str, Any] = {"config": kind, "note": CONFIGS[kind], "load_before": loadavg(), "error": None}
    job = None
    try:
        out = os.path.join(base, "result.json")
        argv = [os.path.abspath(__file__), "--worker", kind, "--result", out, "--root", base, *passthrough]
        env = {"OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
        t0 = time.perf_counter()
        with MemWatch(os.path.join(base, "dcp")) as mem:
            job = launch(argv, nodes=["node0"], ranks_per_node=args.ranks, base_dir=base, env=env)
            mem.pids = [p.pid for p in job.procs]
            codes = job.wait(JOB_TIMEOUT_S)
        res["wall_s"] = time.perf_counter() - t0
        res["job_mem_peak_bytes"] = mem.peak
        res["machine_mem_peak_delta_bytes"] = mem.machine_peak - mem.machine_base
        if any(codes) or not os.path.exists(out):
            tails = "\n".join(f"--- rank {r} ---\n{job.output(r)[-3000:]}" for r in range(len(job.procs)))
            raise RuntimeError(f"exit codes {codes}\n{tails}")
        with open(out) as f:
            res.update(json.load(f))
    except BaseException as exc:  # noqa: BLE001 - one failing configuration must not end the run
        if job is not None:
            job.kill_all()
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"  FAILED: {res['error'][:4000]}")
        if not isinstance(exc, Exception):
            raise
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=float, default=None,
                    help="model + AdamW state per rank, MiB (default 512; --quick: 24)")
    ap.add_argument("--hidden", type=int, default=None, help="width of each Linear layer (default 2048; --quick: 256)")
    ap.add_argument("--batch", type=int, default=None, help="samples per rank per step (default 32; --quick: 16)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 50; --quick: 9)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first, without saves (default 3; --quick: 2)")
    ap.add_argument("--every", type=int, default=None, help="save every k steps (default 5; --quick: 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPUs / ranks)")
    ap.add_argument("--ranks", type=int, default=2, choices=(1, 2), help="ranks on the node (default 2)")
    ap.add_argument("--prepare", action="store_true",
                    help="incluster: ckpt.prepare(state) after the first warm-up step (slot files made before the first save)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, from {', '.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)}); "
                         "'none' also runs again at the end")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole sequence of configurations this many times, interleaved, and pool the "
                         "runs of each (default 1); evens out a machine whose load changes")
    ap.add_argument("--quick", action="store_true", help="small state and few steps: a smoke run")
    ap.add_argument("--json", metavar="OUT", help="also write every step time and summary as JSON to OUT")
    # internal: one rank of one configuration
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    q = args.quick
    for name, full, quick in (("state_mib", 512.0, 24.0), ("hidden", 2048, 256), ("batch", 32, 16),
                              ("steps", 50, 9), ("warmup", 3, 2), ("every", 5, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // args.ranks)
    if args.every < 1 or args.steps < 1 or args.hidden < 1:
        ap.error("--every, --steps and --hidden must be positive")
    if args.layers is None:  # params + 2 AdamW moments, fp32: 12 bytes per parameter
        per_layer = 12 * (args.hidden * args.hidden + args.hidden)
        args.layers = max(1, round(args.state_mib * 2**20 / per_layer))

    if args.worker:
        return worker(args)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    order = list(configs) * args.rounds + (["none"] if "none" in configs and len(configs) > 1 else [])
    passthrough = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--every", str(args.every),
                   "--threads", str(args.threads)] + (["--prepare"] if args.prepare else [])
    state_bytes = 12 * args.layers * (args.hidden * args.hidden + args.hidden)
    info = machine_info()
    import incluster

    info["incluster"] = os.path.dirname(os.path.abspath(incluster.__file__))
    print(f"# training slowdown: {args.ranks} rank(s) (gloo, DDP), {args.layers} x Linear({args.hidden}, {args.hidden}), "
          f"{state_bytes / 2**20:.0f} MiB model+AdamW state per rank, batch {args.batch}, {args.threads} torch "
          f"thread(s) per rank; {args.warmup} warm-up + {args.steps} measured steps, save every {args.every} "
          f"(measured steps 0, {args.every}, ...); {args.rounds} round(s); incluster from {info['incluster']}, "
          f"torch {info['torch']}, {info['cpus']} CPUs, RAM {info.get('ram_bytes', 0) / 2**30:.1f} GiB", flush=True)

    results: list[dict[str, Any]] = []
    for n, kind in enumerate(order):
        label = CONFIGS[kind]
        log(f"[{n + 1}/{len(order)} {kind}] {label}: load {loadavg()} ...")
        res = run_config(kind, args, passthrough)
        res["label"] = label
        if not res.get("error"):
            res["summary"] = summarize(res, args.every)
            s = res["summary"]
            log(f"  done in {res['wall_s']:.0f} s: mean {s['mean_s'] * 1e3:.0f} ms, p50 {s['p50_s'] * 1e3:.0f} ms, "
                f"max {s['max_s'] * 1e3:.0f} ms, save() blocks {fmt_ms(s['blocked_median_s'])} ms (median); "
                f"job memory peak {res.get('job_mem_peak_bytes', 0) / 2**30:.2f} GiB")
        results.append(res)

    rows: list[dict[str, Any]] = []
    for kind in configs:
        runs = [r for r in results if r["config"] == kind]
        ok = [r for r in runs if not r.get("error")]
        loads = [r["load_before"] for r in runs if r.get("load_before") is not None]
        row: dict[str, Any] = {"config": kind, "label": CONFIGS[kind] + (f" ({len(ok)} runs)" if len(ok) > 1 else ""),
                               "note": CONFIGS[kind], "load": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "—",
                               "job_mem_peak_bytes": max((r.get("job_mem_peak_bytes", 0) for r in runs), default=0)}
        if ok:
            row["summary"] = combine(ok)
        if len(ok) < len(runs):
            row["errors"] = [r["error"] for r in runs if r.get("error")]
            if not ok:
                row["error"] = row["errors"][0]
        rows.append(row)
    base = next((r["summary"] for r in rows if r["config"] == "none" and "summary" in r), None)
    print()
    print(f"Step times in ms (per step: the slower rank), {args.steps} measured steps per run, save every "
          f"{args.every}, runs of a configuration pooled; inflation against no checkpointing (all its runs, the "
          f"last one after everything else); steady = from each run's second save on; save() blocks: median "
          f"over every save; staged/durable: medians from the second save on (s from the save() call); "
          f"within-run est. = ((saving step - other steps) + (step after it - other steps)) / ({args.every} x other "
          f"steps), means within each run, so load that drifts between runs cancels; steady within-run = the "
          f"same from each run's second save on; "
          f"load = load average before the runs.")
    print()
    print_tables(rows, base)
    failed = [r for r in rows if r.get("errors")]
    for r in failed:
        print(f"\n{r['config']}: {len(r['errors'])} run(s) FAILED: {r['errors'][0].splitlines()[0][:200]}")
    sys.stdout.flush()
    if args.json:
        report = {"machine": info, "options": {k: v for k, v in vars(args).items() if k not in ("worker", "result", "root")},
                  "state_bytes_per_rank": state_bytes, "table": rows, "runs": results}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        log(f"wrote {args.json}")
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
