"""How much does checkpointing slow down data-parallel training? incluster against DCP.

A CPU training loop on 2 ranks (gloo, ``DistributedDataParallel``: gradients are
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
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RAM_DISK, loadavg, log, machine_info, markdown_table  # noqa: E402 - bench/ is not a package

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


# ======================================================================================
# worker: one rank of one configuration
# ======================================================================================


def build_model(hidden: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)  # identical on every rank, like a broadcast initialisation
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


class DcpSaver:
    """DCP's async_save, used the way its docs ask: one save in flight, the previous one
    waited for first; staging must end before the optimizer changes the state."""

    def __init__(self, root: str, kind: str, rank: int) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.root, self.rank = root, rank
        process = kind.startswith("dcp.process")
        self.ctype = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.stager = None
        if not kind.endswith(".default"):
            # (pinned, shared, async staging, non-blocking copy); pinned and non-blocking
            # need an accelerator. Shared memory only pays off with the process executor.
            self.stager = DefaultStager(StagingOptions(False, process, True, False))
        self.pg = dist.new_group(backend="gloo")  # DCP's collectives never meet DDP's
        self.upload: Any = None
        self.staging: Any = None
        self.folders: list[str] = []
        self.cleaner = ThreadPoolExecutor(1)
        self.records: list[dict[str, float | None]] = []

    def wait_staged(self) -> float:
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self.staging.result()
        self.staging = None
        return time.perf_counter() - t0

    def save(self, step: int, model: Any, optim: Any) -> dict[str, float | None]:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        wait_prev = 0.0
        if self.upload is not None:
            self.upload.result()
            wait_prev = time.perf_counter() - t0
        # Keep the newest two checkpoints; a folder goes once a newer save is complete
        # everywhere (the previous upload ended on every rank: its collectives did).
        while len(self.folders) >= 2:
            old = self.folders.pop(0)
            if self.rank == 0:
                self.cleaner.submit(shutil.rmtree, old, True)
        path = os.path.join(self.root, f"step-{step:09d}")
        self.folders.append(path)
        sd = {"model": model.state_dict(), "optim": optim.state_dict()}
        writer = dcp.FileSystemWriter(path, sync_files=False)
        kwargs: dict[str, Any] = {"storage_writer": writer, "process_group": self.pg, "async_checkpointer_type": self.ctype}
        if self.stager is not None:
            kwargs["async_stager"] = self.stager
        t1 = time.perf_counter()
        resp = dcp.async_save(sd, **kwargs)
        t2 = time.perf_counter()
        if hasattr(resp, "upload_completion"):
            self.upload, self.staging = resp.upload_completion, resp.staging_completion
        else:  # a plain future: staging happened inside the call
            self.upload, self.staging = resp, None
        started = t1
        rec: dict[str, float | None] = {"step": step, "blocked_s": t2 - t0, "call_s": t2 - t1, "wait_prev_s": wait_prev,
                                        "staged_s": None, "durable_s": None}
        if self.staging is not None:
            self.staging.add_done_callback(lambda _f, r=rec: r.__setitem__("staged_s", time.perf_counter() - started))
        else:
            rec["staged_s"] = t2 - t1
        self.upload.add_done_callback(lambda _f, r=rec: r.__setitem__("durable_s", time.perf_counter() - started))
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


def worker(args: argparse.Namespace) -> int:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = args.worker
    model = build_model(args.hidden, args.layers)
    ddp = DDP(model, gradient_as_bucket_view=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, args.hidden, generator=g))
               for _ in range(4)]

    ckpt: Any = None
    dcp_saver: DcpSaver | None = None
    if kind.startswith("incluster"):
        import incluster

        ckpt = incluster.Checkpointer(
            local_dir=os.environ.get("INCLUSTER_LOCAL_DIR", os.path.join(args.root, "incluster")),
            job="bench",
            writer=kind.split(".", 1)[1],
            keep=2,
        )
    elif kind.startswith("dcp"):
        dcp_saver = DcpSaver(os.path.join(args.root, "dcp"), kind, rank)
    state = {"model": model, "optim": optim}
    handles: list[Any] = []

    steps: list[dict[str, Any]] = []
    dist.barrier()
    total = args.warmup + args.steps
    t_run = time.perf_counter()
    for i in range(total):
        j = i - args.warmup  # measured index; < 0 during warm-up
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP all-reduces the gradients here
        t1 = time.perf_counter()
        stage_wait = dcp_saver.wait_staged() if dcp_saver is not None else 0.0
        t2 = time.perf_counter()
        optim.step()  # incluster's pre-step hook waits for its staging here
        optim.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        saved = j >= 0 and j % args.every == 0 and kind != "none"
        blocked = None
        if saved:
            if ckpt is not None:
                h = ckpt.save(i, state)
                handles.append(h)
                blocked = h.blocked_s
            else:
                assert dcp_saver is not None
                blocked = dcp_saver.save(i, model, optim)["blocked_s"]
        t4 = time.perf_counter()
        if j >= 0:
            steps.append({"step": i, "total_s": t4 - t0, "fwd_bwd_s": t1 - t0, "stage_wait_s": stage_wait,
                          "optim_s": t3 - t2, "save_s": t4 - t3 if saved else 0.0, "saved": saved,
                          "save_blocked_s": blocked})
    run_s = time.perf_counter() - t_run

    t0 = time.perf_counter()
    saves: list[dict[str, Any]] = []
    if ckpt is not None:
        ckpt.close()
        saves = [{"step": h.step, "blocked_s": h.blocked_s, "staged_s": h.staged_s, "durable_s": h.durable_s}
                 for h in handles]
    elif dcp_saver is not None:
        dcp_saver.close()
        saves = dcp_saver.records
    drain_s = time.perf_counter() - t0

    import resource

    mine = {"rank": rank, "steps": steps, "saves": saves, "run_s": run_s, "drain_s": drain_s,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        sbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        obytes = sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values() if torch.is_tensor(v))
        with open(args.result, "w") as f:
            json.dump({"config": kind, "ranks": gathered, "param_bytes": sbytes, "optim_bytes": obytes,
                       "layers": args.layers, "hidden": args.hidden, "batch": args.batch,
                       "threads": args.threads}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ======================================================================================
# launcher: runs every configuration as a fresh 2-rank job, collects and reports
# ======================================================================================


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
            job = launch(argv, nodes=["node0"], ranks_per_node=2, base_dir=base, env=env)
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


def summarize(res: dict[str, Any], every: int) -> dict[str, Any]:
    """Per-step time of the job = the slowest rank's time for that step."""
    ranks = res["ranks"]
    n = len(ranks[0]["steps"])
    per_step = [max(r["steps"][i]["total_s"] for r in ranks) for i in range(n)]
    r0 = ranks[0]["steps"]
    saved_idx = [i for i in range(n) if r0[i]["saved"]]
    after_idx = [i for i in range(n) if i > 0 and r0[i - 1]["saved"]]
    steady = per_step[every:] if n > every else per_step

    def mean_of(key: str, idx: list[int] | None = None) -> float | None:
        idx = list(range(n)) if idx is None else idx
        vals = [r["steps"][i][key] for r in ranks for i in idx]
        return statistics.fmean(vals) if vals else None

    def med(vals: list[Any]) -> float | None:
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    save_m = statistics.fmean([per_step[i] for i in saved_idx]) if saved_idx else None
    after_m = statistics.fmean([per_step[i] for i in after_idx]) if after_idx else None
    rest = [per_step[i] for i in range(n) if i not in saved_idx and i not in after_idx]
    other_m = statistics.fmean(rest) if rest else None
    # Within one run, robust to load that drifts between runs: the extra time of the
    # saving step and the step after it (where the background copy runs) over the other
    # steps of the same run, spread over the save interval.
    excess = (save_m - other_m) + (after_m - other_m) if None not in (save_m, after_m, other_m) else None
    saves = [s for r in ranks for s in r["saves"]]
    steady_saves = [s for r in ranks for s in r["saves"][1:]] or saves
    return {
        "steps": n,
        "step_times_s": per_step,
        "mean_s": statistics.fmean(per_step),
        "p50_s": statistics.median(per_step),
        "max_s": max(per_step),
        "steady_mean_s": statistics.fmean(steady),
        "save_step_mean_s": save_m,
        "after_save_mean_s": after_m,
        "other_step_mean_s": other_m,
        "excess_per_save_s": excess,
        "within_run_inflation": excess / (every * other_m) if excess is not None and other_m else None,
        "fwd_bwd_mean_s": mean_of("fwd_bwd_s"),
        "optim_mean_s": mean_of("optim_s"),
        "stage_wait_mean_s": mean_of("stage_wait_s"),
        "saves": len(saves) // max(1, len(ranks)),
        "blocked_median_s": med([s["blocked_s"] for s in saves]),
        "blocked_first_s": med([r["saves"][0]["blocked_s"] for r in ranks if r["saves"]]),
        "staged_median_s": med([s.get("staged_s") for s in steady_saves]),
        "durable_median_s": med([s.get("durable_s") for s in steady_saves]),
        "wait_prev_median_s": med([s.get("wait_prev_s") for s in saves]),
        "drain_s": max(r["drain_s"] for r in ranks),
        "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks),
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs (rounds) pooled: step-time statistics over every step of
    every run; per-save medians over every save; memory and drain: the worst run."""
    sums = [r["summary"] for r in runs]
    if len(sums) == 1:
        return dict(sums[0], runs=1)
    pooled = [t for s in sums for t in s["step_times_s"]]

    def fmean(key: str) -> float | None:
        vals = [s[key] for s in sums if s[key] is not None]
        return statistics.fmean(vals) if vals else None

    def med(key: str) -> float | None:
        vals = [s[key] for s in sums if s[key] is not None]
        return statistics.median(vals) if vals else None

    out = {k: fmean(k) for k in ("steady_mean_s", "save_step_mean_s", "after_save_mean_s", "other_step_mean_s",
                                 "fwd_bwd_mean_s", "optim_mean_s", "stage_wait_mean_s", "excess_per_save_s",
                                 "within_run_inflation")}
    out.update({k: med(k) for k in ("blocked_median_s", "blocked_first_s", "staged_median_s", "durable_median_s",
                                    "wait_prev_median_s")})
    out.update(runs=len(sums), steps=len(pooled), step_times_s=pooled, mean_s=statistics.fmean(pooled),
               p50_s=statistics.median(pooled), max_s=max(pooled), saves=sum(s["saves"] for s in sums),
               drain_s=max(s["drain_s"] for s in sums), max_rss_bytes=max(s["max_rss_bytes"] for s in sums),
               per_run_mean_s=[s["mean_s"] for s in sums])
    return out


def fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def fmt_pct(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "—"
    return f"{(x / base - 1) * 100:+.1f}%"


def print_tables(rows_in: list[dict[str, Any]], base: dict[str, Any] | None) -> None:
    """``rows_in``: one entry per configuration, {config, label, summary | error, load}."""
    base_mean = base["mean_s"] if base else None
    base_steady = base["steady_mean_s"] if base else None
    base_p50 = base["p50_s"] if base else None
    results = rows_in
    headers = ["configuration", "mean", "p50", "max", "inflation", "steady mean", "steady infl.", "p50 infl.",
               "within-run est.", "save() blocks (median)", "staged", "durable", "load"]
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([r["note"], "FAILED", r["error"].splitlines()[0][:60], "", "", "", "", "", "", "", "", "", ""])
            continue
        s = r["summary"]
        rows.append([
            r["label"], fmt_ms(s["mean_s"]), fmt_ms(s["p50_s"]), fmt_ms(s["max_s"]), fmt_pct(s["mean_s"], base_mean),
            fmt_ms(s["steady_mean_s"]), fmt_pct(s["steady_mean_s"], base_steady), fmt_pct(s["p50_s"], base_p50),
            f"{s['within_run_inflation'] * 100:+.1f}%" if s.get("within_run_inflation") is not None else "—",
            f"{s['blocked_median_s'] * 1e3:.1f}" if s["blocked_median_s"] is not None else "—",
            fmt_ms(s["staged_median_s"]), fmt_ms(s["durable_median_s"]),
            r.get("load", "—"),
        ])
    print(markdown_table(headers, rows, right=[False] + [True] * (len(headers) - 1)))
    print()
    headers = ["configuration", "save step", "step after save", "other steps", "fwd+bwd", "optim.step",
               "DCP staging wait", "first save() blocks", "wait prev save", "drain at end", "peak RSS/rank",
               "job memory peak"]
    rows = []
    for r in results:
        if r.get("error"):
            continue
        s = r["summary"]
        rows.append([
            r["label"], fmt_ms(s["save_step_mean_s"]), fmt_ms(s["after_save_mean_s"]), fmt_ms(s["other_step_mean_s"]),
            fmt_ms(s["fwd_bwd_mean_s"]), fmt_ms(s["optim_mean_s"]),
            fmt_ms(s["stage_wait_mean_s"]) if r["config"].startswith("dcp") else "—",
            f"{s['blocked_first_s'] * 1e3:.1f}" if s["blocked_first_s"] is not None else "—",
            fmt_ms(s["wait_prev_median_s"]) if r["config"].startswith("dcp") else "—",
            fmt_ms(s["drain_s"]), f"{s['max_rss_bytes'] / 2**30:.2f} GiB",
            f"{r.get('job_mem_peak_bytes', 0) / 2**30:.2f} GiB",
        ])
    print(markdown_table(headers, rows, right=[False] + [True] * (len(headers) - 1)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=float, default=None,
                    help="model + AdamW state per rank, MiB (default 512; --quick: 24)")
    ap.add_argument("--hidden", type=int, default=None, help="width of each Linear layer (default 2048; --quick: 256)")
    ap.add_argument("--batch", type=int, default=None, help="samples per rank per step (default 32; --quick: 16)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 50; --quick: 9)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first, without saves (default 3; --quick: 2)")
    ap.add_argument("--every", type=int, default=None, help="save every k steps (default 5; --quick: 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPUs / 2)")
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
        args.threads = max(1, (os.cpu_count() or 2) // 2)
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
                   "--threads", str(args.threads)]
    state_bytes = 12 * args.layers * (args.hidden * args.hidden + args.hidden)
    info = machine_info()
    import incluster

    info["incluster"] = os.path.dirname(os.path.abspath(incluster.__file__))
    print(f"# training slowdown: 2 ranks (gloo, DDP), {args.layers} x Linear({args.hidden}, {args.hidden}), "
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
          f"steps), means within each run, so load that drifts between runs cancels; "
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
