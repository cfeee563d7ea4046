"""One configuration of ``bench/persistent.py``, in its own process: the training loop,
every step timed, saving with incluster (RAM, and every Nth save persistent) or DCP
(``DcpSaver``), then what the saves left in the persistent target.

Launched by the driver (``bench/persistent.py --worker KIND ...``) as a plain child
process; it writes its step and save times to ``--result`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Any

from _common import DcpAsyncSaver, build_mlp, loadavg  # noqa: E402 - bench/ is not a package

# kind -> what it does: one of them per worker process; the driver runs them in turn
CONFIGS: dict[str, str] = {
    "none": "no checkpointing",
    "incluster.ram": "incluster, RAM only, every k",
    "incluster.persist": "incluster, RAM every k + persistent every N",
    "dcp.thread": "dcp.async_save every kN, thread, kept stager(F,F,T,F)",
    "dcp.process": "dcp.async_save every kN, process, kept stager(F,T,T,F)",
}
DEFAULT_CONFIGS = ["none", "incluster.ram", "incluster.persist", "dcp.thread", "dcp.process"]


def _tree_size(path: str) -> int:
    n = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, name)).st_size
    return n


class DcpSaver(DcpAsyncSaver):
    """DCP's async_save the way its docs ask (``DcpAsyncSaver``): files synced, the
    default process group, a kept stager; records what the persistent table needs."""

    def __init__(self, root: str, kind: str) -> None:
        super().__init__(root, process=kind == "dcp.process", stager=True, sync_files=True, remove_old=True)

    def record(self, step: int, path: str, t0: float, t1: float, t2: float, wait_prev: float) -> dict[str, Any]:
        return {"step": step, "call_s": t2 - t1, "wait_prev_s": wait_prev, "save_call_s": t2 - t0,
                "staged_s": None, "persisted_s": None, "persisted": None, "path": path}

    def uploaded(self, rec: dict[str, Any], f: Any, seconds: float) -> None:
        rec["persisted_s"] = seconds
        rec["persisted"] = f.exception() is None

    def close(self) -> None:  # type: ignore[override]
        super().close()


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
    model = build_mlp(args.hidden, args.layers)
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
