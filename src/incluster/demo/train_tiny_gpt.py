"""Train a tiny GPT with data parallelism and in-cluster checkpoints.

An ordinary training script using only incluster's public API. Run it on a real cluster
exactly as any torchrun job, one command per node:

    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id run-7 examples/train_tiny_gpt.py --steps 1000 --save-every 10 --persistent s3://bucket/run

``--rdzv-id`` names the job, the same at every launch: a relaunch resumes it.

Each node keeps checkpoints in its RAM disk (INCLUSTER_LOCAL_DIR, default
/dev/shm/incluster) with a replica on the next node; every Nth also goes to --persistent.
After any restart (same nodes, a spare in a failed node's place, ranks moved) it resumes
from the newest step the cluster still holds. With --fsdp the parameters and optimizer
state are sharded (FSDP2) instead of replicated (DDP); either way a restart on fewer or
more ranks restores the same step, resharded. `incluster demo` runs it on one machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import incluster


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 4, context: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        mask: torch.Tensor = self.mask  # type: ignore[assignment]  # a registered buffer
        h = self.blocks(h, mask=mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def batch(step: int, rank: int, size: int, context: int, device: torch.device) -> torch.Tensor:
    """Synthetic data that depends only on (step, rank): a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(step * 1_000_003 + rank)
    start = torch.randint(0, 256, (size, 1), generator=g)
    stride = torch.randint(1, 7, (size, 1), generator=g)
    return ((start + stride * torch.arange(context + 1)) % 256).to(device)


def _full(v: torch.Tensor) -> bytes:
    """A value's bytes as a whole; a sharded (DTensor) value is gathered (a collective)."""
    if isinstance(v, DTensor):
        v = v.full_tensor()
    return v.detach().cpu().contiguous().numpy().tobytes()


def digest(state: dict) -> str:
    """A checksum of the whole model and optimizer state, to show a restore is bitwise.
    It does not depend on the world size; with --fsdp every rank must call it."""
    h = hashlib.sha256()
    for k, v in sorted(state["model"].state_dict().items()):
        h.update(k.encode() + _full(v))
    for pid, s in sorted(state["optim"].state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{pid}/{k}".encode() + _full(v))
    return h.hexdigest()[:16]


def parallelize(model: TinyGPT, fsdp: bool, device: torch.device) -> nn.Module:
    """DDP (a full replica on every rank) or FSDP2 (each block, then the rest, sharded
    over all ranks); returns the module to call."""
    if not fsdp:
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--persistent", default=None, help="path or fsspec URL of the persistent tier")
    p.add_argument("--persistent-every", type=int, default=4, help="every Nth checkpoint also goes there")
    p.add_argument("--persistent-bandwidth", type=float, default=0, help="cap it (MB/s) to rehearse cloud storage")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--run-dir", default=os.environ.get("INCLUSTER_RUN_DIR"), help="goodput event logs")
    p.add_argument("--report", default=None, help="write this rank's summary (JSON) into this folder")
    p.add_argument("--restore-only", action="store_true", help="restore, report, and exit")
    p.add_argument("--fsdp", action="store_true", help="shard the state with FSDP2 instead of replicating it (DDP)")
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (pacing a demo)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TinyGPT(dim=args.dim, layers=args.layers).to(device)
    net = parallelize(model, args.fsdp, device)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state: dict[str, Any] = {"model": model, "optim": optim, "progress": {"step": -1, "tokens": 0}}

    options = {"max_bytes_per_s": args.persistent_bandwidth * 1e6} if args.persistent_bandwidth else None
    ckpt = incluster.Checkpointer(
        replicas=1,
        persistent=args.persistent,
        persistent_every=args.persistent_every if args.persistent else None,
        persistent_options=options,
        run_dir=args.run_dir,
    )
    t = time.perf_counter()
    start = ckpt.load(state)
    report: dict = {"rank": rank, "world": dist.get_world_size(), "node": ckpt.config.node, "restored": start,
                    "load_s": time.perf_counter() - t}
    if ckpt.last_restore is not None:
        fields = ("source", "source_rank", "source_node", "old_world", "bytes", "seconds", "notes")
        report["restore"] = {k: getattr(ckpt.last_restore, k, None) for k in fields}
    report["restored_digest"] = digest(state)
    report["saved"], report["losses"] = {}, {}
    out = os.path.join(args.report, f"rank-{rank}.json") if args.report else None

    def write_report() -> None:
        if out:
            with open(out + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(out + ".tmp", out)

    write_report()
    if args.restore_only:
        ckpt.close()
        dist.destroy_process_group()
        return
    loss_fn = nn.CrossEntropyLoss()
    step_times: list[float] = []
    handles: list[Any] = []  # saves not known durable yet (the demo loses a node only after one is)
    for step in range(0 if start is None else start + 1, args.steps):
        t_step = time.perf_counter()
        data = batch(step, rank, args.batch, 64, device)
        logits = net(data[:, :-1])
        loss = loss_fn(logits.reshape(-1, 256), data[:, 1:].reshape(-1))
        loss.backward()
        optim.step()  # waits for the previous checkpoint's copy (registered automatically)
        optim.zero_grad(set_to_none=True)
        state["progress"] = {"step": step, "tokens": state["progress"]["tokens"] + data.numel()}
        ckpt.record_step(step)
        report["losses"][step] = round(loss.item(), 5)
        if step % args.save_every == 0:
            report["saved"][step] = digest(state)
            handles.append(ckpt.save(step, state))  # returns at once; copies overlap the next step
        for h in [h for h in handles if h.done()]:
            handles.remove(h)
            if h.durable.exception() is None:
                report["durable"] = max(report.get("durable", -1), h.step)
        step_times.append(time.perf_counter() - t_step)
        report["step_s"] = sorted(step_times)[len(step_times) // 2]
        write_report()
        if args.step_delay:
            time.sleep(args.step_delay)
    ckpt.close()
    report["done"] = True
    write_report()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
