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
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _common import build_mlp  # noqa: E402 - bench/ is not a package


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

