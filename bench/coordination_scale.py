"""What does coordinating a save cost as the job grows? incluster against DCP.

For each world size (default 2, 4, 8, 16 processes; gloo on 127.0.0.1; one simulated node
per rank) it launches the ranks once and, in that one job, saves a tiny state (default
8 KiB in 16 tensors per rank, distinct names per rank like a fully sharded model) with:

  incluster (thread)      Checkpointer(writer="thread"): the commit and the store client
                          run on threads of the rank's own process
  incluster (process)     Checkpointer(writer="process"), the default: one writer process
                          per rank holds the store clients (doubles the process count)
  incluster (1 replica)   thread writer with replicas=1 (when the installed incluster has
                          the option): each shard is also sent to a rank on another node,
                          peer to peer over the writers' own gloo group. That traffic is
                          data (the shard and its sidecar), not coordination; it is shown
                          so the two can be told apart. The rows above use replicas=0.
  dcp.save                torch.distributed.checkpoint.save to /dev/shm
  dcp.save +cache         the same with DefaultSavePlanner(enable_plan_caching=True)
  dcp.async_save          thread executor, default stager
  dcp.async_save +cache   the same with plan caching

Per save it reports

  msgs @rank0, KiB @rank0 TCP data segments and payload bytes (in + out) on rank 0's
                          sockets, read from the kernel (``ss -ti``: data_segs_in/out,
                          bytes_received/bytes_sent) before and after the save. incluster:
                          the job store's server side (it lives in rank 0's process, so
                          every store request of every rank is here) plus rank 0's gloo
                          sockets (none are used). DCP: rank 0's gloo sockets.
  msgs/rank, KiB/rank     the same for the busiest other rank's own sockets (its store
                          client connections, in its writer process too, and its gloo
                          sockets): the per-rank cost.
  ops/rank                the coordination calls one rank makes (max over ranks):
                          incluster store operations (counted by wrapping the TCPStore
                          client the StoreCoordinator uses; thread writer only), DCP
                          object collectives (wrapping the torch.distributed functions
                          that torch/distributed/checkpoint/utils.py ``_DistWrapper``
                          calls) with, in brackets, the tensor collectives under them.
  coord ms med / max      time spent coordinating. incluster: from the rank's local commit
                          to its learning the global outcome (store add, outcome wait;
                          with a replica also the replica exchange);
                          DCP: time inside the object collectives (the planning gather and
                          scatter, the write-result gather and metadata broadcast). Both
                          include waiting for the slowest rank. med: over all ranks and
                          saves; max: median over saves of the slowest rank.
  save() ms               how long the call blocks the trainer (median over ranks, saves).
  durable ms              until the save is complete on every rank (median over saves of
                          the slowest rank).

The incluster store is hosted by rank 0, so "@rank0" for incluster is the whole job's
store traffic and grows with W by construction; what stays flat is each rank's share.
The JSON also records open connections (rank 0's store server side, one rank's store
client and gloo connections) and every store operation of the thread writer by key.

Not counted: the setup traffic (process group, the incluster constructor's one exchange
of the store address and replica partners) and the benchmark's own synchronisation between saves, which runs
over the default process group's TCPStore (its port is excluded from the counts).
Before each save every rank waits for all ranks to be ready (so saves start together);
after it every rank waits for all ranks to finish (so the counters see the whole save).

On a small machine the larger sizes oversubscribe the cores heavily (16 ranks, and for
the process writer 16 writer processes too, on 2 cores; ``--writer thread`` skips it): times there measure scheduling
as much as coordination; the message and byte counts do not depend on it.

    python bench/coordination_scale.py                        # 2,4,8,16; ~4 minutes on 2 cores
    python bench/coordination_scale.py --quick                # 2,4; a smoke run
    python bench/coordination_scale.py --sizes 2,8 --saves 5 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402 - bench/ is not a package
    loadavg,
    log,
    machine_info,
    make_state,
    markdown_table,
    median,
    parse_size,
    scratch_dir,
)

# system -> (writer, replicas). Without replicas the store traffic is all there is on the
# save path, which is what DCP's planning collectives are compared with; "+replica" adds
# one in-cluster replica per shard (peer-to-peer over the writers' own gloo group), when
# the installed incluster has the option.
INCLUSTER_SYSTEMS = {
    "incluster-thread": ("thread", 0),
    "incluster-process": ("process", 0),
    "incluster-thread+replica": ("thread", 1),
}
DCP_SYSTEMS = {
    "dcp.save": ("sync", False),
    "dcp.save+cache": ("sync", True),
    "dcp.async_save": ("async", False),
    "dcp.async_save+cache": ("async", True),
}
ALL_SYSTEMS = [*INCLUSTER_SYSTEMS, *DCP_SYSTEMS]
LABELS = {
    "incluster-thread": "incluster (thread writer)",
    "incluster-process": "incluster (process writer)",
    "incluster-thread+replica": "incluster (thread, 1 replica)",
    "dcp.save": "dcp.save",
    "dcp.save+cache": "dcp.save +plan cache",
    "dcp.async_save": "dcp.async_save",
    "dcp.async_save+cache": "dcp.async_save +plan cache",
}
SAVE_TIMEOUT_S = 300.0


# =========================================================================================
# Wire counters: the kernel's per-socket TCP statistics (ss -ti), per process.
# =========================================================================================

_ADDR = re.compile(r"^\s*\d+\s+\d+\s+(\S+)\s+(\S+)(.*)$")
_PID = re.compile(r"pid=(\d+),")
_FIELDS = ("bytes_sent", "bytes_received", "data_segs_out", "data_segs_in")
_FIELD_RE = {f: re.compile(rf"\b{f}:(\d+)") for f in _FIELDS}
_KINDS = ("server", "client", "gloo")


def _port(addr: str) -> int:
    try:
        return int(addr.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return -1


def tcp_sockets() -> list[dict[str, Any]]:
    """Every established TCP socket on this machine with its owner pids and counters."""
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, timeout=60
    ).stdout
    socks: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace() or (cur is None):
            m = _ADDR.match(line)
            if m is None:
                continue
            cur = {
                "lport": _port(m.group(1)),
                "rport": _port(m.group(2)),
                "pids": {int(p) for p in _PID.findall(m.group(3))},
                **{f: 0 for f in _FIELDS},
            }
            socks.append(cur)
        else:
            for f, rx in _FIELD_RE.items():
                mm = rx.search(line)
                if mm:
                    cur[f] = int(mm.group(1))
    return socks


def wire_snapshot(pids: set[int], exclude_ports: set[int], server_port: int | None) -> dict[str, dict[str, int]]:
    """Totals over this rank's sockets (its trainer and writer processes), excluding the
    benchmark's sync store: ``server`` = the job store's server side (local port
    ``server_port``), ``client`` = connections to the job store, ``gloo`` = the rest."""
    tot = {k: {**{f: 0 for f in _FIELDS}, "conns": 0} for k in _KINDS}
    for s in tcp_sockets():
        if not (s["pids"] & pids):
            continue
        if s["lport"] in exclude_ports or s["rport"] in exclude_ports:
            continue
        if server_port is not None and s["lport"] == server_port:
            kind = "server"
        elif server_port is not None and s["rport"] == server_port:
            kind = "client"
        else:
            kind = "gloo"
        for f in _FIELDS:
            tot[kind][f] += s[f]
        tot[kind]["conns"] += 1
    return tot


def wire_delta(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {
        k: {
            "msgs": (b[k]["data_segs_in"] - a[k]["data_segs_in"]) + (b[k]["data_segs_out"] - a[k]["data_segs_out"]),
            "bytes": (b[k]["bytes_received"] - a[k]["bytes_received"]) + (b[k]["bytes_sent"] - a[k]["bytes_sent"]),
            "conns": b[k]["conns"],  # open connections at the end of the save
        }
        for k in _KINDS
    }


# =========================================================================================
# Call counters: wrap the store client and the collectives, record count, bytes, time.
# =========================================================================================


class Calls:
    """Coordination calls made by this process, grouped by save (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.store_ops: list[tuple[str, str, float]] = []  # (op, key, seconds)
            self.object_colls: list[tuple[str, float]] = []  # (name, seconds)
            self.tensor_colls: list[str] = []
            self.pickled = 0

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            ops = [o for o in self.store_ops if o[1].startswith("incluster/")]
            return {
                "store_ops": len(ops),
                "store_op_kinds": sorted({o[0] for o in ops}),
                "store_op_list": [f"{o[0]} {o[1]}" for o in ops],
                "store_op_s": sum(o[2] for o in ops if o[0] != "wait"),
                "store_wait_s": sum(o[2] for o in ops if o[0] == "wait"),
                "object_colls": len(self.object_colls),
                "object_coll_s": sum(o[1] for o in self.object_colls),
                "tensor_colls": len(self.tensor_colls),
                "pickled_bytes": self.pickled,
            }


CALLS = Calls()


def instrument_torch() -> None:
    """Wrap, in this process, the calls DCP and the incluster store client make."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    # Object collectives, as _DistWrapper (torch/distributed/checkpoint/utils.py) calls
    # them: ``dist.gather_object(...)`` looks the name up on torch.distributed each time.
    def wrap_object(name: str) -> None:
        orig = getattr(dist, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                with CALLS.lock:
                    CALLS.object_colls.append((name, time.perf_counter() - t0))

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        setattr(dist, name, wrapper)

    for name in ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object", "barrier"):
        wrap_object(name)

    # The tensor collectives under them and the pickling, looked up as globals of c10d.
    def wrap_tensor(name: str) -> None:
        orig = getattr(c10d, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with CALLS.lock:
                CALLS.tensor_colls.append(name)
            return orig(*args, **kwargs)

        setattr(c10d, name, wrapper)

    for name in ("all_gather", "gather", "scatter", "broadcast"):
        wrap_tensor(name)

    orig_o2t = c10d._object_to_tensor

    def o2t(obj: Any, device: Any, group: Any) -> Any:
        tensor, size = orig_o2t(obj, device, group)
        with CALLS.lock:
            CALLS.pickled += int(size.item() if hasattr(size, "item") else size)
        return tensor, size

    c10d._object_to_tensor = o2t

    # The job store client: StoreCoordinator does ``from torch.distributed import TCPStore``
    # when it is created, so a subclass put there sees every operation it makes.
    base = dist.TCPStore

    class CountingTCPStore(base):  # type: ignore[misc, valid-type]
        def _rec(self, op: str, key: Any, t0: float) -> None:
            k = key[0] if isinstance(key, (list, tuple)) and key else key
            with CALLS.lock:
                CALLS.store_ops.append((op, str(k), time.perf_counter() - t0))

        def add(self, key: str, value: int) -> int:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().add(key, value)
            self._rec("add", key, t0)
            return r

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().compare_set(key, expected, desired)
            self._rec("compare_set", key, t0)
            return r

        def get(self, key: str) -> bytes:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().get(key)
            self._rec("get", key, t0)
            return r

        def set(self, key: str, value: Any) -> None:  # type: ignore[override]
            t0 = time.perf_counter()
            super().set(key, value)
            self._rec("set", key, t0)

        def check(self, keys: list[str]) -> bool:  # type: ignore[override]
            t0 = time.perf_counter()
            r = super().check(keys)
            self._rec("check", keys, t0)
            return r

        def wait(self, keys: list[str], *timeout: Any) -> None:  # type: ignore[override]
            t0 = time.perf_counter()
            super().wait(keys, *timeout)
            self._rec("wait", keys, t0)

    dist.TCPStore = CountingTCPStore  # type: ignore[misc]


# =========================================================================================
# The rank worker: one process per rank; runs every system in turn.
# =========================================================================================


class Sync:
    """Start and end every save together, over the default group's store (not counted)."""

    def __init__(self, store: Any, world: int) -> None:
        self.store = store
        self.world = world

    def all(self, tag: str) -> None:
        if self.store.add(f"bench/{tag}/n", 1) == self.world:
            self.store.set(f"bench/{tag}/go", b"1")
        self.store.wait([f"bench/{tag}/go"], datetime.timedelta(seconds=SAVE_TIMEOUT_S))


def incluster_has_replicas() -> bool:
    import inspect

    from incluster import config

    return "replicas" in inspect.signature(config.resolve).parameters


def run_incluster(
    mode: str, replicas: int, system: str, state: dict[str, Any], n_saves: int, sync: Sync, ctx: dict[str, Any]
) -> list[dict[str, Any]]:
    import incluster
    from incluster.checkpointer import Checkpointer

    local_done: dict[int, float] = {}
    orig = Checkpointer._local_done

    def patched(self: Any, job: Any, handle: Any, fut: Any) -> None:
        if fut.exception() is None:
            local_done[job.step] = time.perf_counter() - handle.started
        orig(self, job, handle, fut)

    Checkpointer._local_done = patched  # type: ignore[method-assign]
    options: dict[str, Any] = {"writer": mode, "keep": 2, "slot_timeout_s": SAVE_TIMEOUT_S}
    if incluster_has_replicas():
        options["replicas"] = replicas
    elif replicas:
        raise RuntimeError("this incluster has no replicas option")
    ckpt = incluster.Checkpointer(job=system.replace("+", "-"), **options)
    try:
        addr = ckpt._store_address
        job_port = addr.port if addr is not None else None
        pids = {os.getpid()} | ({ckpt.writer_pid} if ckpt.writer_pid else set())
        samples = []
        for step in range(n_saves):
            tag = f"{system}/{step}"
            before = wire_snapshot(pids, ctx["exclude_ports"], job_port)
            CALLS.reset()
            sync.all(tag + "/start")
            h = ckpt.save(step, state)
            h.wait(SAVE_TIMEOUT_S)
            calls = CALLS.snapshot()
            sync.all(tag + "/end")
            after = wire_snapshot(pids, ctx["exclude_ports"], job_port)
            local_s = local_done.get(step)
            samples.append(
                {
                    "step": step,
                    "blocked_s": h.blocked_s,
                    "staged_s": h.staged_s,
                    "local_s": local_s,
                    "durable_s": h.durable_s,
                    "coord_s": (h.durable_s - local_s) if (h.durable_s is not None and local_s is not None) else None,
                    "wire": wire_delta(before, after),
                    "calls": calls,
                    "calls_counted": mode == "thread",
                    "replica_targets": list(getattr(ckpt, "replica_targets", ()) or ()),
                }
            )
        return samples
    finally:
        ckpt.close()
        Checkpointer._local_done = orig  # type: ignore[method-assign]


def run_dcp(
    kind: str, caching: bool, system: str, state: dict[str, Any], n_saves: int, sync: Sync, ctx: dict[str, Any]
) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    def clear_plan_cache() -> None:  # class-level caches, shared by every planner instance
        for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                     "_cached_metadata", "_cached_final_save_plan"):
            cache = getattr(SavePlanner, name, None)
            if isinstance(cache, dict):
                cache.clear()

    clear_plan_cache()
    root = os.path.join(ctx["base_dir"], "dcp", system.replace("+", "_"))
    pids = {os.getpid()}
    samples = []
    try:
        for step in range(n_saves):
            tag = f"{system}/{step}"
            path = os.path.join(root, f"step-{step}")
            planner = DefaultSavePlanner(enable_plan_caching=caching)
            before = wire_snapshot(pids, ctx["exclude_ports"], None)
            CALLS.reset()
            sync.all(tag + "/start")
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if kind == "sync":
                    dcp.save(state, checkpoint_id=path, planner=planner)
                    blocked = durable = time.perf_counter() - t0
                else:
                    fut = dcp.async_save(state, checkpoint_id=path, planner=planner)
                    blocked = time.perf_counter() - t0
                    upload: Any = getattr(fut, "upload_completion", fut)
                    upload.result(SAVE_TIMEOUT_S)
                    durable = time.perf_counter() - t0
            calls = CALLS.snapshot()
            sync.all(tag + "/end")
            after = wire_snapshot(pids, ctx["exclude_ports"], None)
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
            samples.append(
                {
                    "step": step,
                    "blocked_s": blocked,
                    "durable_s": durable,
                    "coord_s": calls["object_coll_s"],
                    "wire": wire_delta(before, after),
                    "calls": calls,
                    "calls_counted": True,
                }
            )
    finally:
        clear_plan_cache()
    return samples


def worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=SAVE_TIMEOUT_S))
    instrument_torch()
    store = c10d._get_default_store()
    sync = Sync(store, world)
    ctx = {"base_dir": cfg["base_dir"], "exclude_ports": {int(os.environ["MASTER_PORT"])}}
    state = make_state(cfg["state_bytes"], cfg["tensors"])
    state = {f"rank{rank}.{k}": v for k, v in state.items()}  # each rank owns its shard's names
    n_saves = cfg["warmup"] + cfg["saves"]
    out: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "systems": {}, "errors": {}}
    for system in cfg["systems"]:
        sync.all(f"{system}/begin")
        try:
            if system in INCLUSTER_SYSTEMS:
                mode, replicas = INCLUSTER_SYSTEMS[system]
                samples = run_incluster(mode, replicas, system, state, n_saves, sync, ctx)
            else:
                kind, caching = DCP_SYSTEMS[system]
                samples = run_dcp(kind, caching, system, state, n_saves, sync, ctx)
            out["systems"][system] = samples
        except Exception as exc:  # noqa: BLE001 - one system failing must not hide the others
            out["errors"][system] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            log(f"rank {rank}: {system} failed: {exc}")
            # peers may be stuck in this system's collectives; stop here rather than hang
            break
    with open(os.path.join(cfg["base_dir"], f"result-{rank}.json"), "w") as f:
        json.dump(out, f)
    sync.all("finish")
    dist.destroy_process_group()


# =========================================================================================
# The driver: launch a job per world size, gather and summarise.
# =========================================================================================


def run_world(world: int, systems: list[str], args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    from incluster.testing.launch import launch

    with scratch_dir(f"incluster-coord-w{world}-") as base:
        cfg = {
            "base_dir": base,
            "systems": systems,
            "saves": args.saves,
            "warmup": args.warmup,
            "state_bytes": args.state_bytes,
            "tensors": args.tensors,
        }
        t0 = time.monotonic()
        job = launch(
            [os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
            nodes=[f"n{i}" for i in range(world)],
            ranks_per_node=1,
            base_dir=base,
            env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        )
        try:
            codes = job.wait(timeout)
        except BaseException:
            job.kill_all()
            raise
        finally:
            job.kill_all()  # no-op when all exited; never leaves a rank behind
        results = []
        for r in range(world):
            p = os.path.join(base, f"result-{r}.json")
            if os.path.exists(p):
                with open(p) as f:
                    results.append(json.load(f))
        bad = [r for r, c in enumerate(codes) if c != 0]
        if bad or len(results) != world:
            tail = job.output(bad[0] if bad else 0)[-3000:]
            raise RuntimeError(f"world {world}: ranks {bad} exited {[codes[r] for r in bad]}; rank log tail:\n{tail}")
        return {"world": world, "wall_s": time.monotonic() - t0, "ranks": results}


def summarise(world_result: dict[str, Any], systems: list[str], warmup: int) -> list[dict[str, Any]]:
    ranks = sorted(world_result["ranks"], key=lambda r: r["rank"])
    world = world_result["world"]
    rows = []
    for system in systems:
        per_rank = [r["systems"].get(system) for r in ranks]
        if any(s is None for s in per_rank):
            errs = {r["rank"]: r["errors"].get(system) for r in ranks if r["errors"].get(system)}
            rows.append({"world": world, "system": system, "error": errs or "did not run"})
            continue
        n = len(per_rank[0])
        saves = range(warmup, n)

        def rank0(step: int, what: str) -> int:
            # the store's server side already holds rank 0's own store requests
            w = per_rank[0][step]["wire"]
            return w["server"][what] + w["gloo"][what]

        def own(r: int, step: int, what: str) -> int:
            w = per_rank[r][step]["wire"]
            return w["client"][what] + w["gloo"][what]

        def busiest_other(step: int, what: str) -> int:
            vals = [own(r, step, what) for r in range(1, world)]
            return max(vals) if vals else 0

        counted = per_rank[0][0]["calls_counted"]
        is_dcp = system in DCP_SYSTEMS

        def ops(step: int) -> int:
            key = "object_colls" if is_dcp else "store_ops"
            return max(per_rank[r][step]["calls"][key] for r in range(world))

        row = {
            "world": world,
            "system": system,
            "saves": len(saves),
            "rank0_msgs": median([rank0(s, "msgs") for s in saves]),
            "rank0_bytes": median([rank0(s, "bytes") for s in saves]),
            "rank0_store_msgs": median([per_rank[0][s]["wire"]["server"]["msgs"] for s in saves]),
            "rank0_gloo_msgs": median([per_rank[0][s]["wire"]["gloo"]["msgs"] for s in saves]),
            "rank0_store_conns": per_rank[0][-1]["wire"]["server"].get("conns"),
            "rank_gloo_conns": per_rank[-1][-1]["wire"]["gloo"].get("conns"),
            "rank_store_conns": per_rank[-1][-1]["wire"]["client"].get("conns"),
            "rank0_store_bytes": median([per_rank[0][s]["wire"]["server"]["bytes"] for s in saves]),
            "rank0_gloo_bytes": median([per_rank[0][s]["wire"]["gloo"]["bytes"] for s in saves]),
            "other_store_bytes": median([max(per_rank[r][s]["wire"]["client"]["bytes"] for r in range(1, world)) for s in saves]),
            "other_gloo_bytes": median([max(per_rank[r][s]["wire"]["gloo"]["bytes"] for r in range(1, world)) for s in saves]),
            "all_ranks_gloo_msgs": median([sum(per_rank[r][s]["wire"]["gloo"]["msgs"] for r in range(world)) for s in saves]),
            "all_ranks_gloo_bytes": median([sum(per_rank[r][s]["wire"]["gloo"]["bytes"] for r in range(world)) for s in saves]),
            "other_msgs": median([busiest_other(s, "msgs") for s in saves]),
            "other_bytes": median([busiest_other(s, "bytes") for s in saves]),
            "ops_per_rank": median([ops(s) for s in saves]) if counted else None,
            "ops_per_rank_min": min(min(per_rank[r][s]["calls"]["object_colls" if is_dcp else "store_ops"]
                                        for r in range(world)) for s in saves) if counted else None,
            "tensor_colls_per_rank": median([max(per_rank[r][s]["calls"]["tensor_colls"] for r in range(world)) for s in saves]) if is_dcp else None,
            "pickled_bytes_all_ranks": median([sum(per_rank[r][s]["calls"]["pickled_bytes"] for r in range(world)) for s in saves]) if is_dcp else None,
            "store_op_ms": (median([per_rank[r][s]["calls"]["store_op_s"] for r in range(world) for s in saves]) or 0) * 1e3 if (counted and not is_dcp) else None,
            "coord_ms_med": _ms(median([per_rank[r][s]["coord_s"] for r in range(world) for s in saves])),
            "coord_ms_max": _ms(median([max(_nz(per_rank[r][s]["coord_s"]) for r in range(world)) for s in saves])),
            "blocked_ms": _ms(median([per_rank[r][s]["blocked_s"] for r in range(world) for s in saves])),
            "durable_ms": _ms(median([max(_nz(per_rank[r][s]["durable_s"]) for r in range(world)) for s in saves])),
        }
        rows.append(row)
    return rows


def _nz(x: float | None) -> float:
    return x if x is not None else float("nan")


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _f(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:
        return "—"
    if abs(x - round(x)) < 1e-9 and digits == 0:
        return f"{int(round(x))}"
    return f"{x:.{digits}f}"


def print_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "W", "system", "msgs @rank0", "KiB @rank0", "msgs/rank", "KiB/rank", "ops/rank",
        "coord ms med", "coord ms max", "save() ms", "durable ms",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([str(r["world"]), LABELS[r["system"]], "error", "", "", "", "", "", "", "", ""])
            continue
        if r["ops_per_rank"] is None:
            ops = "—"
        elif r["system"] in DCP_SYSTEMS:
            ops = f"{_f(r['ops_per_rank'], 0)} ({_f(r['tensor_colls_per_rank'], 0)})"
        else:
            lo, hi = r["ops_per_rank_min"], r["ops_per_rank"]
            ops = f"{_f(lo, 0)}-{_f(hi, 0)}" if lo != hi else _f(hi, 0)
        body.append([
            str(r["world"]),
            LABELS[r["system"]],
            _f(r["rank0_msgs"], 0),
            _f(r["rank0_bytes"] / 1024, 1),
            _f(r["other_msgs"], 0),
            _f(r["other_bytes"] / 1024, 1),
            ops,
            _f(r["coord_ms_med"], 1),
            _f(r["coord_ms_max"], 1),
            _f(r["blocked_ms"], 2),
            _f(r["durable_ms"], 1),
        ])
    table = markdown_table(headers, body, right=[True, False] + [True] * (len(headers) - 2))
    print(table, flush=True)
    return table


def print_growth(rows: list[dict[str, Any]]) -> None:
    """Per system: how rank 0's traffic grows from the smallest to the largest world."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            by.setdefault(r["system"], []).append(r)
    lines = []
    for system, rs in by.items():
        rs.sort(key=lambda r: r["world"])
        if len(rs) < 2 or not rs[0]["rank0_bytes"]:
            continue
        a, b = rs[0], rs[-1]
        lines.append(
            f"  {LABELS[system]:<28} W {a['world']}->{b['world']} ({b['world'] / a['world']:.0f}x ranks): "
            f"rank-0 msgs {a['rank0_msgs']:.0f}->{b['rank0_msgs']:.0f} ({b['rank0_msgs'] / max(a['rank0_msgs'], 1):.1f}x), "
            f"rank-0 bytes {a['rank0_bytes'] / 1024:.1f}->{b['rank0_bytes'] / 1024:.1f} KiB "
            f"({b['rank0_bytes'] / max(a['rank0_bytes'], 1):.1f}x), "
            f"per-rank bytes {a['other_bytes'] / 1024:.1f}->{b['other_bytes'] / 1024:.1f} KiB "
            f"({b['other_bytes'] / max(a['other_bytes'], 1):.1f}x)"
        )
    if lines:
        print("\ngrowth with world size:", *lines, sep="\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma-separated world sizes (default 2,4,8,16; --quick: 2,4)")
    ap.add_argument("--saves", type=int, default=None, help="measured saves per system (default 8; --quick: 3)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up saves per system, left out (default 2)")
    ap.add_argument("--state", default="8K", help="state bytes per rank (default 8K)")
    ap.add_argument("--tensors", type=int, default=16, help="tensors per rank (default 16)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"subset of {','.join(ALL_SYSTEMS)}")
    ap.add_argument("--writer", choices=["thread", "process", "both"], default="both",
                    help="which incluster writer(s) to run (default both; 'thread' halves the process count)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per world size before giving up (default 900)")
    ap.add_argument("--quick", action="store_true", help="2 and 4 ranks, few saves: a smoke run")
    ap.add_argument("--json", metavar="OUT", help="also write every sample and the summary as JSON to OUT")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._worker:
        worker(json.loads(args._worker))
        return 0
    # A plain `kill` must still remove the scratch folders in /dev/shm (finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if shutil.which("ss") is None:
        log("coordination_scale: needs `ss` (iproute2) to read per-socket TCP counters")
        return 2
    sizes = [int(x) for x in (args.sizes or ("2,4" if args.quick else "2,4,8,16")).split(",") if x.strip()]
    if any(w < 2 for w in sizes):
        ap.error("world sizes must be >= 2 (coordination needs peers)")
    args.saves = args.saves if args.saves is not None else (3 if args.quick else 8)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    args.state_bytes = parse_size(args.state)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ALL_SYSTEMS:
            ap.error(f"unknown system {s!r}; choose from {','.join(ALL_SYSTEMS)}")
    if args.writer != "both":
        systems = [s for s in systems if s not in INCLUSTER_SYSTEMS or INCLUSTER_SYSTEMS[s][0] == args.writer]
    if "incluster-thread+replica" in systems and not incluster_has_replicas():
        log("coordination_scale: this incluster has no `replicas` option; skipping incluster-thread+replica")
        systems.remove("incluster-thread+replica")
    timeout = args.timeout or 900.0

    info = machine_info()
    log(f"coordination_scale: sizes {sizes}, {args.saves} saves (+{args.warmup} warm-up) per system, "
        f"state {args.state_bytes} B in {args.tensors} tensors per rank; {info['cpus']} CPUs, torch {info['torch']}")
    report: dict[str, Any] = {"machine": info, "config": {
        "sizes": sizes, "saves": args.saves, "warmup": args.warmup, "state_bytes": args.state_bytes,
        "tensors": args.tensors, "systems": systems}, "worlds": [], "summary": []}
    rows: list[dict[str, Any]] = []
    for world in sizes:
        log(f"world {world}: launching {world} ranks (load {loadavg()})")
        try:
            res = run_world(world, systems, args, timeout)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other sizes
            log(f"world {world}: failed: {exc}")
            rows.append({"world": world, "system": systems[0], "error": str(exc)})
            report["worlds"].append({"world": world, "error": str(exc)})
            continue
        log(f"world {world}: done in {res['wall_s']:.0f} s")
        report["worlds"].append(res)
        rows.extend(summarise(res, systems, args.warmup))

    print()
    print(f"Save-time coordination per save, tiny state ({args.state_bytes} B in {args.tensors} tensors per rank), "
          f"gloo on 127.0.0.1, {info['cpus']} CPUs, torch {info['torch']}; medians over {args.saves} saves.")
    print("msgs/KiB: TCP data segments and payload bytes in+out, from the kernel's socket counters. "
          "@rank0: rank 0's process (incluster: the job store's server side, every rank's store traffic; "
          "DCP: rank 0's gloo sockets). /rank: the busiest other rank's own sockets. ops/rank: store operations "
          "(incluster) or object collectives (tensor collectives) per rank (DCP).\n")
    table = print_table(rows)
    print_growth(rows)
    report["summary"] = rows
    report["table"] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
