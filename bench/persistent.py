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
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RAM_DISK, loadavg, log, machine_info, markdown_table, median  # noqa: E402 - bench/ is not a package

CONFIGS: dict[str, str] = {
    "none": "no checkpointing",
    "incluster.ram": "incluster, RAM only, every k",
    "incluster.persist": "incluster, RAM every k + persistent every N",
    "dcp.thread": "dcp.async_save every kN, thread, kept stager(F,F,T,F)",
    "dcp.process": "dcp.async_save every kN, process, kept stager(F,T,T,F)",
}
DEFAULT_CONFIGS = ["none", "incluster.ram", "incluster.persist", "dcp.thread", "dcp.process"]
JOB_TIMEOUT_S = 1800.0
MiB = 1 << 20


# ======================================================================================
# worker: one configuration, in its own process
# ======================================================================================


def build_model(hidden: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _tree_size(path: str) -> int:
    n = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, name)).st_size
    return n


class DcpSaver:
    """DCP's async_save the way its docs ask: one save in flight, the previous one waited
    for first; staging must end before the optimizer changes the state."""

    def __init__(self, root: str, kind: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.root = root
        process = kind == "dcp.process"
        self.ctype = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        # (pinned, shared, async staging, non-blocking copy): pinned and non-blocking need
        # an accelerator; shared memory only pays off with the process executor.
        self.stager = DefaultStager(StagingOptions(False, process, True, False))
        self.upload: Any = None
        self.staging: Any = None
        self.folders: list[str] = []
        self.cleaner = ThreadPoolExecutor(1)
        self.records: list[dict[str, Any]] = []

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
        while len(self.folders) >= 2:  # keep the newest two, like persistent_keep=2
            self.cleaner.submit(shutil.rmtree, self.folders.pop(0), True)
        path = os.path.join(self.root, f"step-{step:09d}")
        self.folders.append(path)
        sd = {"model": model.state_dict(), "optim": optim.state_dict()}
        writer = dcp.FileSystemWriter(path, sync_files=True)
        t1 = time.perf_counter()
        resp = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=self.ctype, async_stager=self.stager)
        t2 = time.perf_counter()
        if hasattr(resp, "upload_completion"):
            self.upload, self.staging = resp.upload_completion, resp.staging_completion
        else:  # a plain future: staging happened inside the call
            self.upload, self.staging = resp, None
        rec: dict[str, Any] = {"step": step, "call_s": t2 - t1, "wait_prev_s": wait_prev, "save_call_s": t2 - t0,
                               "staged_s": None, "persisted_s": None, "persisted": None, "path": path}
        if self.staging is not None:
            self.staging.add_done_callback(lambda _f, r=rec: r.__setitem__("staged_s", time.perf_counter() - t1))
        else:
            rec["staged_s"] = t2 - t1

        def done(f: Any, r: dict[str, Any] = rec) -> None:
            r["persisted_s"] = time.perf_counter() - t1
            r["persisted"] = f.exception() is None

        self.upload.add_done_callback(done)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        try:
            if self.upload is not None:
                self.upload.result()
        finally:
            self.stager.close()
            self.cleaner.shutdown(wait=True)


def _init_solo_group() -> None:
    """A world-size-1 gloo group: DCP's process executor asks the group for rank/world."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


def worker(args: argparse.Namespace) -> int:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    kind = args.worker
    ram = os.path.join(args.ram_root, kind)
    target = os.path.join(args.target, kind)
    os.makedirs(ram, exist_ok=True)
    os.makedirs(target, exist_ok=True)
    if kind.startswith("dcp"):
        _init_solo_group()
    model = build_model(args.hidden, args.layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1000)
    batches = [(torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, args.hidden, generator=g))
               for _ in range(4)]
    ckpt: Any = None
    dcp_saver: DcpSaver | None = None
    if kind.startswith("incluster"):
        import incluster

        opts: dict[str, Any] = {}
        if kind == "incluster.persist":
            opts = {"persistent": target, "persistent_every": args.every, "persistent_keep": 2}
        ckpt = incluster.Checkpointer(local_dir=os.path.join(ram, "local"), job="bench", writer=args.writer,
                                      keep=2, replicas=0, **opts)
    elif kind.startswith("dcp"):
        dcp_saver = DcpSaver(target, kind)
    state = {"model": model, "optim": optim}

    dcp_every = args.save_every * args.every
    handles: list[tuple[Any, dict[str, Any]]] = []
    steps: list[dict[str, Any]] = []
    total = args.warmup + args.steps
    pending_stage: dict[str, Any] | None = None  # the save whose staging the next optimizer step waits for
    load0 = loadavg()
    t_run = time.perf_counter()
    for i in range(total):
        j = i - args.warmup  # measured index; < 0 during warm-up
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        if ckpt is not None:
            ckpt.wait_staged()  # what the optimizer pre-step hook would wait for
        elif dcp_saver is not None:
            dcp_saver.wait_staged()
        t2 = time.perf_counter()
        if pending_stage is not None:
            pending_stage["stage_wait_s"] = t2 - t1
            pending_stage = None
        optim.step()
        optim.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        saved = False
        rec: dict[str, Any] | None = None
        if j >= 0 and ckpt is not None and j % args.save_every == 0:
            h = ckpt.save(i, state)
            rec = {"step": i, "save_call_s": h.blocked_s, "stage_wait_s": None, "staged_s": None, "durable_s": None,
                   "persisted_s": None, "persisted": None,
                   "due": kind == "incluster.persist" and (j // args.save_every) % args.every == 0}

            def on_persisted(f: Any, r: dict[str, Any] = rec, h: Any = h) -> None:
                r["persisted_s"] = time.perf_counter() - h.started
                r["persisted"] = f.result() if f.exception() is None else f"error: {f.exception()}"

            h.persisted.add_done_callback(on_persisted)
            handles.append((h, rec))
            saved = True
        elif j >= 0 and dcp_saver is not None and j % dcp_every == 0:
            rec = dcp_saver.save(i, model, optim)
            rec["due"] = True
            rec["stage_wait_s"] = None
            saved = True
        t4 = time.perf_counter()
        if rec is not None:
            pending_stage = rec
        if j >= 0:
            steps.append({"step": i, "total_s": t4 - t0, "fwd_bwd_s": t1 - t0, "stage_wait_s": t2 - t1,
                          "optim_s": t3 - t2, "save_s": t4 - t3 if saved else 0.0, "saved": saved})
    run_s = time.perf_counter() - t_run
    if pending_stage is not None:  # the last save's staging: waited for at the close
        pending_stage["stage_wait_s"] = 0.0

    t0 = time.perf_counter()
    saves: list[dict[str, Any]] = []
    shard_bytes = None
    manifests = 0
    if ckpt is not None:
        ckpt.close()  # drains every save, the last upload included
        for h, rec in handles:
            rec.update(staged_s=h.staged_s, durable_s=h.durable_s)
            saves.append(rec)
        if kind == "incluster.persist":
            job = os.path.join(target, "bench")
            for name in sorted(os.listdir(job)) if os.path.isdir(job) else []:
                mpath = os.path.join(job, name, "COMMITTED.json")
                if os.path.exists(mpath):
                    manifests += 1
                    with open(mpath) as f:
                        shard_bytes = json.load(f)["ranks"][0]["size"]
        else:  # the size of the newest shard in the RAM disk
            sizes = [os.path.getsize(os.path.join(d, n)) for d, _s, ns in os.walk(ram) for n in ns
                     if n.startswith("step-") and n.endswith(".safetensors")]
            shard_bytes = max(sizes) if sizes else None
    elif dcp_saver is not None:
        dcp_saver.close()
        saves = dcp_saver.records
        for rec in saves:
            rec["stage_wait_s"] = rec["stage_wait_s"] or 0.0
        kept = [r["path"] for r in saves if os.path.isdir(r["path"])]
        manifests = sum(os.path.exists(os.path.join(p, ".metadata")) for p in kept)
        if kept:
            shard_bytes = _tree_size(kept[-1])
        for r in saves:
            r.pop("path", None)
    drain_s = time.perf_counter() - t0
    if kind.startswith("dcp"):
        import torch.distributed as dist

        dist.destroy_process_group()

    import resource

    sbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    obytes = sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values() if torch.is_tensor(v))
    with open(args.result, "w") as f:
        json.dump({"config": kind, "steps": steps, "saves": saves, "run_s": run_s, "drain_s": drain_s,
                   "shard_bytes": shard_bytes, "persistent_kept": manifests, "state_bytes": sbytes + obytes,
                   "load_start": load0, "load_end": loadavg(),
                   "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)
    return 0


# ======================================================================================
# upload throughput: FsspecTier.write from a mapped shard vs a plain copy, same target
# ======================================================================================


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


# ======================================================================================
# launcher
# ======================================================================================


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


def summarize(res: dict[str, Any], save_every: int) -> dict[str, Any]:
    steps = res["steps"]
    times = [s["total_s"] for s in steps]
    saves = res["saves"]
    blocked = [(s["save_call_s"] or 0.0) + (s["stage_wait_s"] or 0.0) for s in saves]
    due = [s for s in saves if s.get("due")]
    persisted = [s for s in due if s.get("persisted") is True]
    skipped = [s for s in due if s.get("persisted") is False]
    failed = [s for s in due if isinstance(s.get("persisted"), str)]
    nbytes = res.get("shard_bytes")
    rates = []
    if nbytes:
        for s in persisted:
            start = s.get("durable_s") if res["config"].startswith("incluster") else s.get("staged_s")
            if s.get("persisted_s") is not None and start is not None and s["persisted_s"] > start:
                rates.append(nbytes / (s["persisted_s"] - start))
    return {
        "steps": len(times),
        "mean_s": statistics.fmean(times),
        "p50_s": statistics.median(times),
        "max_s": max(times),
        "saves": len(saves),
        "persistent_due": len(due),
        "persistent_ok": len(persisted),
        "persistent_skipped": len(skipped),
        "persistent_failed": len(failed),
        "blocked_median_s": median(blocked),
        "blocked_max_s": max(blocked) if blocked else None,
        "blocked_first_s": blocked[0] if blocked else None,
        "save_call_median_s": median([s["save_call_s"] for s in saves]),
        "stage_wait_median_s": median([s["stage_wait_s"] for s in saves]),
        "persisted_median_s": median([s["persisted_s"] for s in persisted]),
        "persisted_max_s": max((s["persisted_s"] for s in persisted), default=None),
        "upload_Bps_median": median(rates),
        "drain_s": res["drain_s"],
    }


def _f(x: float | None, scale: float = 1e3, digits: int = 0) -> str:
    return "—" if x is None else f"{x * scale:.{digits}f}"


def _pct(x: float | None, base: float | None) -> str:
    return "—" if x is None or not base else f"{(x / base - 1) * 100:+.1f}%"


def _load(r: dict[str, Any]) -> str:
    a, b = r.get("load_before"), r.get("load_after")
    return "—" if a is None else f"{a:.1f}-{b:.1f}" if b is not None else f"{a:.1f}"


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

    # ---- report ------------------------------------------------------------------------
    nones = [r["summary"] for r in results if r["config"] == "none" and "summary" in r]
    base = statistics.fmean([t for r in results if r["config"] == "none" and "summary" in r
                             for t in (s["total_s"] for s in r["steps"])]) if nones else None
    base_p50 = statistics.median([t for r in results if r["config"] == "none" and "summary" in r
                                  for t in (s["total_s"] for s in r["steps"])]) if nones else None
    pooled = pool(results, configs, k)
    headers = ["configuration", "saves (persistent ok/due, skipped)", "mean step ms", "inflation", "p50 infl.",
               "max step ms",
               "trainer blocked/save ms: median", "max", "first", "persisted after s: median", "max",
               "upload MiB/s", "load"]
    rows: list[list[str]] = []
    for r in pooled:
        label = r["note"] + (f" ({r['runs']} runs)" if r["runs"] > 1 else "")
        if r.get("error"):
            rows.append([label, "FAILED", r["error"].splitlines()[0][:50]] + [""] * (len(headers) - 3))
            continue
        s = r["summary"]
        pers = (f"{s['saves']} ({s['persistent_ok']}/{s['persistent_due']}, {s['persistent_skipped']})"
                if s["persistent_due"] else (f"{s['saves']}" if s["saves"] else "—"))
        rows.append([label, pers, _f(s["mean_s"]), _pct(s["mean_s"], base) if r["config"] != "none" else "",
                     _pct(s["p50_s"], base_p50) if r["config"] != "none" else "", _f(s["max_s"]),
                     _f(s["blocked_median_s"], digits=1), _f(s["blocked_max_s"], digits=1),
                     _f(s["blocked_first_s"], digits=1), _f(s["persisted_median_s"], 1, 2),
                     _f(s["persisted_max_s"], 1, 2),
                     _f(s["upload_Bps_median"], 1 / MiB, 0), _load(r)])
    if tput is not None:
        mb = tput["bytes"] / MiB
        rows.append([f"upload alone: FsspecTier.write, mapped shard ({mb:.0f} MiB)", "", "", "", "", "", "", "", "",
                     _f(tput["incluster_median_s"], 1, 2), _f(max(tput["incluster_s"]), 1, 2),
                     _f(tput["incluster_Bps"], 1 / MiB, 0), f"{tput['load_before']:.1f}-{tput['load_after']:.1f}"])
        rows.append([f"upload alone: copyfile + fsync ({mb:.0f} MiB)", "", "", "", "", "", "", "", "",
                     _f(tput["plain_median_s"], 1, 2), _f(max(tput["plain_s"]), 1, 2),
                     _f(tput["plain_Bps"], 1 / MiB, 0), ""])
    print()
    print(f"Per configuration: {args.steps} measured steps; inflation of the mean step time against no checkpointing "
          f"(both 'none' runs pooled: {_f(base)} ms; p50 infl.: of the median step); trainer blocked per save = "
          f"the save call (+ DCP's wait for its "
          f"previous save) + the staging wait before the next optimizer.step(); persisted after = from the save call "
          f"until the step is in the persistent target (incluster: in its manifest; DCP: upload_completion); upload "
          f"MiB/s = shard bytes / (persisted - durable in RAM) for incluster, / (persisted - staged) for DCP, median; "
          f"'upload alone' rows: the same bytes written alone after training, median of {args.repeats} (persisted "
          f"after = seconds per write); load = 1-minute load average before-after.")
    print()
    print(markdown_table(headers, rows, right=[False] + [True] * (len(headers) - 1)))
    print()
    for line in observations(results, pooled, base, tput, args, others):
        print(f"- {line}")
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


def pool(results: list[dict[str, Any]], configs: list[str], save_every: int) -> list[dict[str, Any]]:
    """One row per configuration: the steps and saves of all its successful runs pooled."""
    out = []
    for kind in configs:
        runs = [r for r in results if r["config"] == kind]
        ok = [r for r in runs if "summary" in r]
        row: dict[str, Any] = {"config": kind, "note": CONFIGS[kind], "runs": len(ok),
                               "load_before": min((r["load_before"] for r in runs if r.get("load_before") is not None),
                                                  default=None),
                               "load_after": max((r["load_after"] for r in runs if r.get("load_after") is not None),
                                                 default=None)}
        if not ok:
            row["error"] = runs[0].get("error") if runs else "not run"
            out.append(row)
            continue
        merged = {"config": kind, "steps": [s for r in ok for s in r["steps"]],
                  "saves": [s for r in ok for s in r["saves"]], "drain_s": max(r["drain_s"] for r in ok),
                  "shard_bytes": next((r["shard_bytes"] for r in ok if r.get("shard_bytes")), None)}
        row["summary"] = summarize(merged, save_every)
        row["summary"]["blocked_first_s"] = max(r["summary"]["blocked_first_s"] or 0.0 for r in ok) or None
        if len(ok) < len(runs):
            row["errors"] = [r["error"] for r in runs if r.get("error")]
        out.append(row)
    return out


def observations(results: list[dict[str, Any]], pooled: list[dict[str, Any]], base: float | None,
                 tput: dict[str, Any] | None, args: argparse.Namespace, others: list[str]) -> list[str]:
    by = {r["config"]: r["summary"] for r in pooled if "summary" in r}
    out = []
    loads = [x for r in results for x in (r.get("load_before"), r.get("load_after")) if x is not None]
    cpus = os.cpu_count() or 1
    if loads:
        busy = f" ({', '.join(others)})" if others else ""
        out.append(f"load average {min(loads):.1f}-{max(loads):.1f} on {cpus} CPUs during the run"
                   + (f"; other work was running at the same time{busy}, so absolute times are noisy and "
                      f"inflation figures carry that noise" if others or max(loads) > cpus else ""))
    nones = [r["summary"]["mean_s"] for r in results if r["config"] == "none" and "summary" in r]
    if len(nones) >= 2:
        out.append(f"no-checkpointing mean step over the run's {len(nones)} 'none' runs: "
                   f"{' -> '.join(f'{x * 1e3:.0f}' for x in nones)} ms (spread {(max(nones) / min(nones) - 1) * 100:.0f}%); "
                   f"inflations smaller than that spread are within noise")
    for kind in by:
        per = [r["summary"]["mean_s"] for r in results if r["config"] == kind and "summary" in r]
        if len(per) > 1 and kind != "none":
            out.append(f"{kind} per run: {', '.join(f'{x * 1e3:.0f}' for x in per)} ms mean step")
    ip, ir = by.get("incluster.persist"), by.get("incluster.ram")
    if ip and base:
        out.append(f"incluster with persistent saves: {(ip['mean_s'] / base - 1) * 100:+.1f}% mean step time, the "
                   f"trainer blocked {_f(ip['blocked_median_s'], digits=1)} ms per save (median, max "
                   f"{_f(ip['blocked_max_s'], digits=1)} ms) for {ip['saves']} saves, {ip['persistent_ok']} of "
                   f"{ip['persistent_due']} persistent ones in the manifest after {_f(ip['persisted_median_s'], 1, 2)} s "
                   f"(median)" + (f"; {ip['persistent_skipped']} skipped because the previous upload was still running"
                                  if ip["persistent_skipped"] else ""))
        if ir:
            out.append(f"the uploads' own cost: incluster.persist {ip['mean_s'] * 1e3:.0f} ms vs incluster.ram "
                       f"{ir['mean_s'] * 1e3:.0f} ms mean step ({(ip['mean_s'] / ir['mean_s'] - 1) * 100:+.1f}%)")
    for kind in ("dcp.thread", "dcp.process"):
        d = by.get(kind)
        if d and base:
            out.append(f"{kind}: {(d['mean_s'] / base - 1) * 100:+.1f}% mean step time for {d['saves']} saves (every "
                       f"{args.save_every * args.every} steps), blocked {_f(d['blocked_median_s'], digits=1)} ms per save "
                       f"(median, max {_f(d['blocked_max_s'], digits=1)} ms), persisted after "
                       f"{_f(d['persisted_median_s'], 1, 2)} s (median)")
    dk = min((k_ for k_ in ("dcp.thread", "dcp.process") if k_ in by), key=lambda k_: by[k_]["blocked_median_s"],
             default=None)
    if ip and dk:
        dbest = by[dk]
        out.append(f"per save, incluster blocks the trainer {_f(ip['blocked_median_s'], digits=1)} ms (median; "
                   f"max {_f(ip['blocked_max_s'], digits=1)} ms) against {_f(dbest['blocked_median_s'], digits=1)} "
                   f"ms for DCP's least-blocking configuration ({dk}; max {_f(dbest['blocked_max_s'], digits=1)} ms), "
                   f"while also saving to RAM {args.every}x as often; time until persisted: "
                   f"{_f(ip['persisted_median_s'], 1, 2)} s vs {_f(dbest['persisted_median_s'], 1, 2)} s (medians)")
    if tput:
        out.append(f"upload alone ({tput['bytes'] / MiB:.0f} MiB): incluster's FsspecTier.write "
                   f"{tput['incluster_Bps'] / MiB:.0f} MiB/s vs copyfile+fsync {tput['plain_Bps'] / MiB:.0f} MiB/s: "
                   f"ratio {tput['incluster_Bps'] / tput['plain_Bps']:.2f} (1.00 = as fast as a plain copy; best runs "
                   f"{tput['incluster_best_Bps'] / MiB:.0f} vs {tput['plain_best_Bps'] / MiB:.0f} MiB/s); per-run "
                   f"seconds incluster {[round(x, 2) for x in tput['incluster_s']]}, plain "
                   f"{[round(x, 2) for x in tput['plain_s']]}")
        if ip and ip["upload_Bps_median"]:
            out.append(f"during training the upload ran at {ip['upload_Bps_median'] / MiB:.0f} MiB/s (median), "
                       f"{ip['upload_Bps_median'] / tput['plain_Bps']:.2f}x the plain copy alone: it shares the CPUs "
                       f"and the disk with training (and includes sidecar, manifest and retention)")
    return out


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
