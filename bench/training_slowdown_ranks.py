"""One rank of one ``bench/training_slowdown.py`` configuration: the DDP training loop,
every step timed, saving with incluster or DCP (``DcpSaver``) every ``--every`` steps.

Launched by the driver (``bench/training_slowdown.py --worker KIND ...``) through
``incluster.testing.launch``, 2 ranks per job; rank 0 writes every rank's step and save
times to ``--result`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from _common import DcpAsyncSaver, build_mlp  # noqa: E402 - bench/ is not a package


class DcpSaver(DcpAsyncSaver):
    """DCP's async_save, used the way its docs ask (``DcpAsyncSaver``), on a gloo group
    of its own; files not synced; only rank 0 removes old folders."""

    def __init__(self, root: str, kind: str, rank: int) -> None:
        import torch.distributed as dist

        super().__init__(root, process=kind.startswith("dcp.process"), stager=not kind.endswith(".default"),
                         process_group=dist.new_group(backend="gloo"),  # DCP's collectives never meet DDP's
                         sync_files=False, remove_old=rank == 0)
        self.rank = rank

    def record(self, step: int, path: str, t0: float, t1: float, t2: float, wait_prev: float) -> dict[str, Any]:
        return {"step": step, "blocked_s": t2 - t0, "call_s": t2 - t1, "wait_prev_s": wait_prev,
                "staged_s": None, "durable_s": None}

    def uploaded(self, rec: dict[str, Any], f: Any, seconds: float) -> None:
        rec["durable_s"] = seconds


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
    model = build_mlp(args.hidden, args.layers)  # identical on every rank, like a broadcast initialisation
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
        if ckpt is not None and args.prepare and i == 0:
            prepared = ckpt.prepare(state)  # the optimizer state exists now: the state has its full shape
        if ckpt is not None and args.prepare and i == args.warmup - 1:
            prepared.result()
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

