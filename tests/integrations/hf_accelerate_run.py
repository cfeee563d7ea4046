"""One process (or one DDP rank) of a tiny Accelerate training loop that checkpoints into
incluster (run by test_accelerate).

    hf_accelerate_run.py OUT_DIR LOCAL_DIR JOB MODE [WAIT_STEP]
    MODE: "full"   - train from scratch to the end;
          "crash"  - the same, waiting at WAIT_STEP until its save is durable; the caller
                     sets INCLUSTER_FAULTS to SIGKILL the process while a later save is
                     half written;
          "resume" - AcceleratorCheckpoint.load() in a fresh process, then train to the end.

A small MLP with dropout, AdamW with a warmup schedule, a shuffled DataLoader without a
seeded sampler, a counter registered with ``register_for_checkpointing``; CPU. A job named
"*-gen" shuffles with the loader's own generator (``generator=``); any other draws its
order from the global RNG (on several ranks: accelerate seeds the sampler's generator
from it). With RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, Accelerate runs DDP on gloo.
Writes OUT_DIR/<job>-<mode>[-rank<r>].json (loss per step, the step restored, the
registered counter) and .pt (final weights).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

torch.set_num_threads(1)

from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import incluster  # noqa: E402
from incluster.integrations.accelerate import AcceleratorCheckpoint  # noqa: E402

EPOCHS = 3  # 5 batches each: 15 steps
SAVES = {3, 5, 6, 9, 10, 12, 15}  # mid-epoch and end-of-epoch steps


class Counter:
    """A user object registered for checkpointing: samples seen and a running loss sum."""

    def __init__(self) -> None:
        self.seen = 0
        self.total = torch.zeros((), dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "total": self.total.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen, self.total = int(sd["seen"]), sd["total"].clone()


def main() -> None:
    out, local_dir, job, mode = sys.argv[1:5]
    wait_step = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(40, 6, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    own = torch.Generator().manual_seed(5) if job.endswith("-gen") else None
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=own)

    accelerator = Accelerator(cpu=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    ckpt = incluster.Checkpointer(local_dir=local_dir, job=job, writer="thread")
    ac = AcceleratorCheckpoint(accelerator, ckpt)
    start = ac.load() if mode == "resume" else None
    step = 0 if start is None else start
    losses: dict[int, float] = {}
    for epoch in range(ac.epoch, EPOCHS):
        for xb, yb in ac.batches(loader, epoch):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            losses[step] = loss.item()
            counter.seen += len(xb)
            counter.total += loss.detach().double()
            if step in SAVES:
                handle = ac.save(step)
                if step == wait_step:
                    handle.durable.result(timeout=60)
    ac.close()
    name = f"{job}-{mode}" + (f"-rank{accelerator.process_index}" if accelerator.num_processes > 1 else "")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"losses": losses, "resumed": start, "seen": counter.seen, "total": counter.total.item(),
                   "accelerator_step": accelerator.step}, f)
    unwrapped = accelerator.unwrap_model(model)
    torch.save({k: v.detach().clone() for k, v in unwrapped.state_dict().items()}, os.path.join(out, f"{name}.pt"))
    accelerator.end_training()  # destroys the process group: a gloo group alive at exit can abort it


if __name__ == "__main__":
    main()
