"""One process, gradient accumulation: fit to step 6 saving every 3 steps, then fit again
with ``ckpt_path="incluster"`` to step 9 (run by test_lightning.py).

    lightning_accumulate.py OUT_JSON

A resumed run's first batch does not step (it accumulates), so ``global_step`` stays at
the restored step for one batch: the callback must not save that step again.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from incluster.integrations.lightning import INCLUSTER, InclusterCheckpoint, InclusterDDPStrategy


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit(max_steps: int, ckpt_path: str | None) -> tuple[int, int | None]:
    strategy = InclusterDDPStrategy(checkpointer=dict(job="accumulate"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, accumulate_grad_batches=2,
        callbacks=[InclusterCheckpoint(every_n_steps=3)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(), ckpt_path=ckpt_path)
    return trainer.global_step, strategy.incluster_restored_step


def main() -> None:
    first = fit(6, None)
    second = fit(9, INCLUSTER)
    with open(sys.argv[1], "w") as f:
        json.dump({"first": first, "second": second}, f)
    if torch.distributed.is_initialized():  # a gloo group alive at interpreter exit can abort it
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
