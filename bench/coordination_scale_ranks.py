"""One rank of a ``bench/coordination_scale.py`` job: runs every system in turn, each save
started and ended together on every rank, and records its wire and call counts and times.

Launched by the driver (``bench/coordination_scale.py --_worker CFG``) through
``incluster.testing.launch``; each rank writes ``result-<rank>.json`` into the job's folder.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import traceback
import warnings
from typing import Any

from _common import log, make_state  # noqa: E402 - bench/ is not a package
from coordination_scale_calls import CALLS, instrument_torch
from coordination_scale_wire import wire_delta, wire_snapshot

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
SAVE_TIMEOUT_S = 300.0


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
