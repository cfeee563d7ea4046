"""What do persistent saves cost the trainer? incluster's persistent tier against DCP.

One process (world size 1), CPU, one run. A training loop (a stack of ``Linear`` layers
trained with AdamW; model + optimizer state about ``--state-mib``) times every step under
each configuration, each run as a fresh child process:

  none                no checkpointing (run first and again last, to show drift)
  incluster.ram       incluster.Checkpointer(writer="process"), a save to the RAM disk
                      every k steps, no persistent tier (what the uploads add on top of)
  incluster.persist   the same, and every Nth save also goes to the persistent tier: a
                      plain folder on the real disk (``--target-root``, default /tmp)
  dcp.thread          torch.distributed.checkpoint.async_save of the same state every k*N
                      steps (the steps incluster uploads) into the same kind of folder;
                      thread executor, a DefaultStager(StagingOptions(False, False, True,
                      False)) kept across saves (cached buffers, staging on a thread)
  dcp.process         the same with AsyncCheckpointerType.PROCESS and
                      StagingOptions(False, True, True, False) (staged into shared memory,
                      so the checkpoint process receives file descriptors, not a copy)

Both systems make persistent copies as durable as each other: incluster's tier writes a
temporary file, fsyncs it, renames it and fsyncs the folder; DCP's FileSystemWriter
keeps its default ``sync_files=True``. Both keep the newest two persistent checkpoints
(incluster: ``persistent_keep=2``; DCP: older folders deleted on a background thread once
a newer save completed). DCP's previous save is waited for before the next ``async_save``
(DCP requires it) and its staging before the next ``optimizer.step()``; incluster's
staging is waited for at the same place (``wait_staged()``, what its optimizer pre-step
hook would do anyway), so both save a consistent state and the wait is timed alike.
Trainer blocking per save = the save call + that staging wait (+ DCP's wait for its
previous save).

Saves happen right after the optimizer step of measured steps 0, k, 2k, ...; incluster's
first save and every Nth after it are persistent (its ``persistent_every`` rule), DCP
saves at measured steps 0, kN, 2kN, ... Time until persisted: from the save call until
``handle.persisted`` is True (the step is in the tier's manifest) / DCP's
``upload_completion`` is done.

Upload throughput is measured twice: (a) during training, the shard's bytes over the
time from durable in RAM (the upload starts then) to persisted; (b) alone, afterwards:
``FsspecTier.write`` of a mapped RAM-disk shard file (what the writer does) against
``shutil.copyfile`` of the same file into the same target folder followed by fsync of the
file and the folder, interleaved, ``--repeats`` times each (medians).

Every folder (RAM disk and target) is created fresh and removed afterwards, whatever
happens. Timings on a small shared machine are noisy: the 1-minute load average is
recorded before and after every configuration, and other benchmark processes seen
running are listed.

    python bench/persistent.py                         # 512 MiB, several minutes
    python bench/persistent.py --quick                 # small state, a smoke run
    python bench/persistent.py --state-mib 256 --steps 48 --save-every 3 --every 4 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RAM_DISK, loadavg, log, machine_info  # noqa: E402 - bench/ is not a package
from persistent_report import MiB, _f, print_report, summarize  # noqa: E402
from persistent_upload import upload_throughput  # noqa: E402
from persistent_worker import CONFIGS, DEFAULT_CONFIGS, worker  # noqa: E402

JOB_TIMEOUT_S = 1800.0


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (longest matching mount point)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) >= len(best):
                        best, kind = parts[1], parts[2]
    return kind


def _other_benchmarks() -> list[str]:
    """Other processes running something under bench/ (not this run): shared-machine noise."""
    mine = {os.getpid()}
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in mine:
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            text = " ".join(a.decode(errors="replace") for a in argv if a)
            if "bench/" in text and "persistent.py" not in text:
                script = next((a for a in text.split() if "bench/" in a), text)
                out.append(os.path.basename(script) + (" (worker)" if "--worker" in text else ""))
    return sorted(set(out))


_children: list[subprocess.Popen[bytes]] = []
_kept: list[str] = []  # the RAM folder of the latest incluster.persist run: its shards feed the upload test


def run_config(kind: str, args: argparse.Namespace, passthrough: list[str], ram_root: str, target: str) -> dict[str, Any]:
    res: dict[str, Any] = {"config": kind, "note": CONFIGS[kind], "load_before": loadavg(), "error": None}
    run_root = tempfile.mkdtemp(prefix=f"run-{kind}-", dir=ram_root)  # fresh per run: no steps left from before
    out = os.path.join(run_root, "result.json")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--result", out, "--ram-root", run_root,
            "--target", target, *passthrough]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _children.append(proc)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        res["wall_s"] = time.perf_counter() - t0
        text = output.decode(errors="replace")
        res["output_tail"] = text[-2000:]
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"exit code {proc.returncode}\n{text[-3000:]}")
        with open(out) as f:
            res.update(json.load(f))
    except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"  FAILED: {res['error'][:3000]}")
    finally:
        if proc.poll() is None:
            proc.kill()  # our own child, by its handle
            proc.wait()
        _children.remove(proc)
        with contextlib.suppress(OSError):
            os.unlink(out)
        # what the run wrote, except the latest incluster.persist run's RAM shards (the
        # upload throughput test reads one); the whole RAM root goes at the end anyway
        shutil.rmtree(os.path.join(target, kind), ignore_errors=True)
        if kind == "incluster.persist" and not res.get("error"):
            for old in _kept:
                shutil.rmtree(old, ignore_errors=True)
            _kept[:] = [run_root]
        else:
            shutil.rmtree(run_root, ignore_errors=True)
    res["load_after"] = loadavg()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=float, default=None, help="model + AdamW state, MiB (default 512; --quick: 24)")
    ap.add_argument("--hidden", type=int, default=None, help="width of each Linear layer (default 2048; --quick: 256)")
    ap.add_argument("--batch", type=int, default=None, help="samples per step (default 32; --quick: 16)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 60; --quick: 12)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first, no saves (default 3; --quick: 2)")
    ap.add_argument("--save-every", type=int, default=None, help="k: incluster saves to RAM every k steps (default 3; --quick: 2)")
    ap.add_argument("--every", type=int, default=None,
                    help="N: every Nth incluster save is persistent; DCP saves every k*N steps (default 4; --quick: 3)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: half the CPUs, at least 1: on a small shared machine more "
                         "threads than free cores make OpenMP's barriers stall whole steps)")
    ap.add_argument("--writer", default="process", choices=("process", "thread"), help="incluster's writer (default process)")
    ap.add_argument("--repeats", type=int, default=None, help="upload throughput repeats per method, after one warm-up each (default 5; --quick: 2)")
    ap.add_argument("--target-root", default="/tmp",
                    help="where the persistent target folder is made: a real disk, not a RAM disk (default /tmp)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, from {', '.join(CONFIGS)}; 'none' also runs again at the end")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole sequence of configurations this many times, interleaved, and pool the runs "
                         "of each (default 1); evens out a machine whose load changes")
    ap.add_argument("--quick", action="store_true", help="small state and few steps: a smoke run")
    ap.add_argument("--json", metavar="OUT", help="also write every step time and summary as JSON to OUT")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--ram-root", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    q = args.quick
    for name, full, quick in (("state_mib", 512.0, 24.0), ("hidden", 2048, 256), ("batch", 32, 16), ("steps", 60, 12),
                              ("warmup", 3, 2), ("save_every", 3, 2), ("every", 4, 3), ("repeats", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // 2)
    if min(args.save_every, args.every, args.steps, args.hidden, args.repeats) < 1:
        ap.error("--save-every, --every, --steps, --hidden and --repeats must be positive")
    if args.layers is None:  # params + 2 AdamW moments, fp32: 12 bytes per parameter
        args.layers = max(1, round(args.state_mib * MiB / (12 * (args.hidden * args.hidden + args.hidden))))
    if args.worker:
        return worker(args)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    order = configs * args.rounds + (["none"] if "none" in configs and len(configs) > 1 else [])
    fs = _fs_type(args.target_root)
    if fs in ("tmpfs", "ramfs"):
        ap.error(f"--target-root {args.target_root} is on {fs}: the persistent target must be a real disk")

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # runs every finally below: children killed, folders removed

    signal.signal(signal.SIGTERM, on_term)
    passthrough = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--save-every", str(args.save_every),
                   "--every", str(args.every), "--threads", str(args.threads), "--writer", args.writer]
    state_bytes = 12 * args.layers * (args.hidden * args.hidden + args.hidden)
    info = machine_info()
    others = _other_benchmarks()
    info.update(load_start=loadavg(), other_benchmarks_at_start=others, target_fs=fs)
    k, n = args.save_every, args.every
    print(f"# persistent saves: 1 process, {args.layers} x Linear({args.hidden}, {args.hidden}) + AdamW = "
          f"{state_bytes / MiB:.0f} MiB state, batch {args.batch}, {args.threads} torch thread(s); {args.warmup} "
          f"warm-up + {args.steps} measured steps, {args.rounds} round(s); incluster saves every k={k} steps to RAM (writer="
          f"{args.writer!r}), every N={n}th save also persistent; DCP every k*N={k * n} steps; target: a fresh "
          f"folder under {args.target_root} ({fs}); torch {info['torch']}, {info['cpus']} CPUs; "
          f"load average {info['load_start']:.2f} at start" + (f"; other benchmarks running: {', '.join(others)}"
                                                                 if others else ""), flush=True)

    ram_root = tempfile.mkdtemp(prefix="bench-persistent-", dir=RAM_DISK if os.path.isdir(RAM_DISK) else None)
    target = tempfile.mkdtemp(prefix="bench-persistent-", dir=args.target_root)
    results: list[dict[str, Any]] = []
    tput: dict[str, Any] | None = None
    try:
        for i, kind in enumerate(order):
            log(f"[{i + 1}/{len(order)} {kind}] {CONFIGS[kind]}: load {loadavg()} ...")
            res = run_config(kind, args, passthrough, ram_root, target)
            if not res.get("error"):
                res["summary"] = s = summarize(res, k)
                log(f"  done in {res['wall_s']:.0f} s: mean step {s['mean_s'] * 1e3:.0f} ms, blocked/save "
                    f"{_f(s['blocked_median_s'], digits=1)} ms median, persisted {s['persistent_ok']}/"
                    f"{s['persistent_due']} (median {_f(s['persisted_median_s'], 1, 2)} s)")
            results.append(res)
        shards = [os.path.join(d, name) for root in _kept for d, _s, names in os.walk(root)
                  for name in names if name.startswith("step-") and name.endswith(".safetensors")]
        src = max(shards, key=os.path.getsize) if shards else None
        made = None
        if src is None:  # incluster.persist did not run or left nothing: a file of the state's size
            made = src = os.path.join(ram_root, "shard.bin")
            block = os.urandom(MiB)
            with open(src, "wb") as f:
                for _ in range(max(1, state_bytes // MiB)):
                    f.write(block)
        log(f"[upload throughput] {os.path.getsize(src) / MiB:.0f} MiB {'(synthetic) ' if made else ''}from the RAM "
            f"disk to {target}, {args.repeats} x each: load {loadavg()} ...")
        load_b = loadavg()
        tput = upload_throughput(src, target, args.repeats)
        tput.update(load_before=load_b, load_after=loadavg(), synthetic=bool(made))
    finally:
        for proc in list(_children):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(ram_root, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        for path in (ram_root, target):
            if os.path.exists(path):
                log(f"WARNING: could not remove {path}")

    pooled, base = print_report(results, configs, tput, args, others)
    sys.stdout.flush()
    if args.json:
        report = {"machine": info, "options": {k_: v for k_, v in vars(args).items()
                                               if k_ not in ("worker", "result", "ram_root", "target")},
                  "state_bytes": state_bytes, "baseline_mean_s": base,
                  "table": [{k_: v for k_, v in r.items() if k_ not in ("steps", "saves")} for r in pooled],
                  "runs": results, "upload_throughput": tput}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        log(f"wrote {args.json}")
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
