"""A plain Accelerate training loop checkpointing into incluster.

The same command starts the job and resumes it after any crash, at the exact batch the
newest complete step had reached:

    accelerate launch examples/accelerate_incluster.py --job demo-accelerate
    # kill it and run the same command again

Everything ``accelerator.save_state()`` would write (models, optimizers, schedulers, the
gradient scaler, objects registered with ``register_for_checkpointing``, RNG states,
``accelerator.step``) plus the data position goes into one incluster state per process,
saved in its node's RAM disk (INCLUSTER_LOCAL_DIR, default /dev/shm/incluster).
"""

from __future__ import annotations

import argparse
import logging

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import incluster
from incluster.integrations.accelerate import AcceleratorCheckpoint


class Tokens:
    """A counter registered for checkpointing: samples seen so far."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.seen = int(sd["seen"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="accelerate-example")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--save-every", type=int, default=20)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).tanh())
    torch.manual_seed(0)  # the same initial model in every run: a resumed run matches an uninterrupted one bitwise
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=a.epochs * 64)

    accelerator = Accelerator()
    loader = DataLoader(data, batch_size=64, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    tokens = Tokens()
    accelerator.register_for_checkpointing(tokens)

    ac = AcceleratorCheckpoint(accelerator, incluster.Checkpointer(job=a.job))
    start = ac.load()  # newest complete step, or None
    step = 0 if start is None else start
    loss = torch.zeros(())
    for epoch in range(ac.epoch, a.epochs):
        ran = False
        for xb, yb in ac.batches(loader, epoch):  # skips what the restored step had consumed
            ran = True
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            tokens.seen += len(xb)
            if step % a.save_every == 0:
                ac.save(step)  # returns in about a millisecond
        if ran:  # (a run restored at the very end of an epoch has nothing left of it)
            accelerator.print(f"epoch {epoch}: step {step}, loss {loss.item():.4f}, samples seen {tokens.seen}")
    if step % a.save_every and step != start:  # a rerun of a finished job trains (and saves) nothing
        ac.save(step)  # the last steps too: a rerun with more epochs goes on from here
    ac.close()  # drains the saves in flight
    accelerator.end_training()  # destroys the process group (gloo can abort at exit otherwise)


if __name__ == "__main__":
    main()
