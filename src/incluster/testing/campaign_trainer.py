"""One rank of the crash campaign's job (:mod:`incluster.testing.campaign`).

    python -m incluster.testing.campaign_trainer OUT STEPS EVERY RUN

Restores, trains a small model with AdamW to STEPS, saving every EVERY steps, and
appends one JSON line per event to ``OUT/r<rank>-run<RUN>.jsonl`` as it goes (the line
is written before the act, so a SIGKILL never hides what was attempted):

- ``start`` (node, writer pid), ``loaded`` (step, digest, restore report) or ``load_error``;
- ``saving`` (step, digest of the state handed to ``save()``), then ``durable`` or
  ``save_error`` (kind, message); ``closed`` at the end.

Options by environment: ``WRITER`` (process|thread), ``TIMEOUT_S``, ``STEP_SLEEP_S``,
``INCLUSTER_PERSISTENT`` (every 2nd save goes there), ``INCLUSTER_FAULTS``, ``NO_WAIT``
(``1``: never wait for a save; the next optimizer step runs while it stages).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

import incluster


def digest(state: dict[str, Any]) -> str:
    """sha256 over every tensor's bytes and every scalar of model, optimizer and extra."""
    h = hashlib.sha256()
    for k, v in sorted(state["model"].state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    for pid, s in sorted(state["optim"].state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{pid}/{k}".encode())
            h.update(v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    h.update(json.dumps(state["extra"], sort_keys=True).encode())
    return h.hexdigest()


class Log:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the run

    def __call__(self, event: str, **kw: Any) -> None:
        self.f.write(json.dumps({"event": event, "t": time.time(), **kw}) + "\n")


def _report(pending: list[Any], log: Log) -> None:
    """Log each finished save of a NO_WAIT run once: durable, or its error."""
    for h in [h for h in pending if h.done()]:
        pending.remove(h)
        try:
            h.wait(0)
            log("durable", step=h.step)
        except incluster.CheckpointError as exc:
            log("save_error", step=h.step, kind=type(exc).__name__, message=str(exc))


def main() -> int:
    out, steps, every, run = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = Log(os.path.join(out, f"r{rank}-run{run}.jsonl"))
    torch.manual_seed(1000 + rank)
    width = 256
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state: dict[str, Any] = {"model": model, "optim": optim, "extra": {"step": 0, "rank": rank}}
    ckpt = incluster.Checkpointer(
        job="camp",
        writer=os.environ.get("WRITER", "process"),
        slot_timeout_s=float(os.environ.get("TIMEOUT_S", "10")),
        persistent_every=2,
    )
    log("start", node=ckpt.config.node, writer_pid=ckpt.writer_pid, pid=os.getpid())
    try:
        start = ckpt.load(state)
    except incluster.CheckpointError as exc:
        log("load_error", kind=type(exc).__name__, message=str(exc), trace=traceback.format_exc()[-3000:])
        return 3
    report = dataclasses.asdict(ckpt.last_restore) if ckpt.last_restore else None
    log("loaded", step=start, digest=digest(state), report=report)
    g = torch.Generator().manual_seed(rank * 7919 + (start or 0))
    pause = float(os.environ.get("STEP_SLEEP_S", "0.05"))
    no_wait = os.environ.get("NO_WAIT") == "1"
    pending: list[Any] = []
    for step in range((start or 0) + 1, steps + 1):
        model(torch.randn(32, width, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        state["extra"]["step"] = step
        time.sleep(pause)  # the rest of a training step
        if step % every == 0:
            log("saving", step=step, digest=digest(state))
            try:
                handle = ckpt.save(step, state)
                if no_wait:  # train on at once: the next optimizer step runs while this one stages
                    pending.append(handle)
                else:
                    handle.wait()
                    log("durable", step=step)
            except incluster.CheckpointError as exc:
                log("save_error", step=step, kind=type(exc).__name__, message=str(exc))
        _report(pending, log)
    try:
        for h in pending:
            h.wait(60)
        _report(pending, log)
        ckpt.close()
    except incluster.CheckpointError as exc:
        _report(pending, log)
        log("save_error", step=None, kind=type(exc).__name__, message=str(exc))
    log("closed")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
