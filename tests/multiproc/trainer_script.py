"""A rank of a small data-parallel job, launched by the multi-process tests.

    python trainer_script.py OUT_DIR STEPS EVERY

Restores (collectively), trains to STEPS saving every EVERY steps, and writes
``OUT_DIR/result-r{rank}-{attempt}.json``: the step restored, a digest of the state
right after the restore, the digest of the state at each save, and any save errors.
Options by environment: ``WRITER`` (process|thread), ``TIMEOUT_S``, ``ATTEMPT``, ``BN=1``
(a BatchNorm layer and a large buffer, both changed in every forward pass), ``FORWARD_AFTER_LOAD=1``
(one training-mode forward pass right after the restore, before anything waits),
``REPLICAS=N`` (replicas per shard), ``LOAD_DELAY_S`` (sleep before ``load()``),
``ARRIVAL_WARN_S`` (how long ``load()`` waits for the other ranks before saying so), ``NOWAIT=1`` (save handles never waited), ``SKIP_SAVES=4,6`` (this rank does not save those
steps: a user error), ``WIRE_PIECE=N`` (a restore's transfers move N-byte pieces through the staged wire NCCL
uses, with CPU buffers, ``WIRE_WINDOW`` per round; the result records the most buffer
bytes any one transfer held).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import incluster


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer, extra: dict) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    for pid, s in sorted(optim.state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{pid}/{k}".encode())
            h.update(v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()


class Tally(torch.nn.Module):
    """A buffer big enough for a restore to land it straight in place, changed by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(70_000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return x


def main() -> int:
    out, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    wire_peak = None
    if os.environ.get("WIRE_PIECE"):
        from incluster.testing.wire import route_through_staged_wire

        wire_peak = route_through_staged_wire(int(os.environ["WIRE_PIECE"]), int(os.environ.get("WIRE_WINDOW", "2")))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    layers = [torch.nn.Linear(32, 64)] + ([torch.nn.BatchNorm1d(64), Tally()] if os.environ.get("BN") else [])
    model = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"step": -1, "rank": rank}
    state = {"model": model, "optim": optim, "extra": extra}
    ckpt = incluster.Checkpointer(
        job="mp", writer=os.environ.get("WRITER", "process"), slot_timeout_s=float(os.environ.get("TIMEOUT_S", "30")),
        **({"replicas": int(os.environ["REPLICAS"])} if "REPLICAS" in os.environ else {}),
    )
    result: dict = {"rank": rank, "node": ckpt.config.node, "writer_pid": ckpt.writer_pid, "digests": {}, "errors": {}}
    result_path = os.path.join(out, f"result-r{rank}-{os.environ.get('ATTEMPT', '0')}.json")
    if os.environ.get("ARRIVAL_WARN_S"):
        from incluster.recovery import meet

        meet.WARN_S = float(os.environ["ARRIVAL_WARN_S"])
    time.sleep(float(os.environ.get("LOAD_DELAY_S", "0")))
    try:
        start = ckpt.load(state)
    except incluster.CheckpointError as exc:
        result["load_error"] = [type(exc).__name__, str(exc)]
        with open(result_path, "w") as f:
            json.dump(result, f)
        ckpt.close()  # a clean exit: no background thread or process group left to abort
        dist.destroy_process_group()
        return 3
    result["restore"] = dataclasses.asdict(ckpt.last_restore) if ckpt.last_restore else None
    result["loaded"] = start
    result["wire_peak"] = wire_peak[0] if wire_peak else None
    result["loaded_digest"] = digest(model, optim, state["extra"])
    if os.environ.get("FORWARD_AFTER_LOAD"):
        with torch.no_grad():
            model(torch.randn(16, 32) * 10)  # BatchNorm statistics change in place, at once
    g = torch.Generator().manual_seed(rank)
    handles: list = []
    for step in range((start or 0) + 1, steps + 1):
        model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        state["extra"]["step"] = step
        if step % every == 0 and str(step) not in os.environ.get("SKIP_SAVES", "").split(","):
            result["digests"][step] = digest(model, optim, state["extra"])
            try:
                h = ckpt.save(step, state)
                if os.environ.get("NOWAIT"):  # the README's loop: handles never waited
                    handles.append(h)
                else:
                    h.wait()
            except incluster.CheckpointError as exc:
                result["errors"][step] = [type(exc).__name__, str(exc)]
        with open(result_path, "w") as f:
            json.dump(result, f)
    try:
        ckpt.close()
    except incluster.CheckpointError as exc:
        result["errors"]["close"] = [type(exc).__name__, str(exc)]
    result["durable"] = [h.step for h in handles if h.durable.done() and h.durable.exception() is None]
    with open(result_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
