"""Train a tiny LightningModule with in-cluster checkpoints; rerun it to resume.

    torchrun --nproc-per-node 2 examples/lightning_incluster.py     # or: python examples/lightning_incluster.py

Every 5 optimizer steps each rank saves its state into this node's RAM disk; run the
same command again (also after a kill) and training continues from the newest step.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from incluster.integrations.lightning import INCLUSTER, InclusterCheckpoint, InclusterDDPStrategy


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=64)


def main() -> None:
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = InclusterDDPStrategy(
        checkpointer=dict(local_dir="/dev/shm/incluster", job="lightning-example", replicas=0),
        process_group_backend="gloo" if not torch.cuda.is_available() else None,
    )
    trainer = pl.Trainer(
        accelerator="auto", devices=devices, strategy=strategy, max_steps=200,
        callbacks=[InclusterCheckpoint(every_n_steps=5)], enable_checkpointing=False, logger=False,
    )
    pl.seed_everything(0)  # the same initial model in every run: a resumed run matches an uninterrupted one bitwise
    trainer.fit(Regressor(), ckpt_path=INCLUSTER)  # resumes when a checkpoint exists
    if trainer.is_global_zero:
        print(f"restored step: {strategy.incluster_restored_step}; finished at step {trainer.global_step}")
    if torch.distributed.is_initialized():  # Lightning leaves it alive; gloo can abort at exit otherwise
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
