"""One process, the callback's bookkeeping (run by test_lightning.py).

    lightning_accumulate.py OUT_JSON PERSISTENT_DIR

- Gradient accumulation: fit to step 6 saving every 3 steps, then fit again with
  ``ckpt_path="incluster"`` to step 9. A resumed run's first batch does not step (it
  accumulates), so ``global_step`` stays at the restored step for one batch: the callback
  must not save that step again.
- The end of fit: a fit to step 10 saves step 10 (not a multiple of 3) as it ends.
- A StatefulDataLoader saved mid-epoch with batches of 4: a resume with batches of 8 is
  refused before it trains; one with batches of 4 trains the batches an uninterrupted run
  trains, into the next epoch.
- A StatefulDataLoader saved on an epoch's last batch: the resume trains the next epoch's
  first batches, not the epoch after it.
- A loader made again each epoch with a larger batch size: a mid-epoch resume with that
  size is not refused (the size saved is the one in use at the save).
- Epochs (``max_epochs``, no accumulation): a fit of one epoch saves its last batch; a fit
  of three resumes there and stops after a mid-epoch save (an exception, as a crash); the
  next fit resumes mid-epoch, at the batch after that save, not at its epoch's start. A fit
  of that job without ``ckpt_path`` is refused before it trains.
- A persistent tier whose schedule uploads only the first save: the fit's last step is
  uploaded too.
- A fit EarlyStopping ends (at an epoch's end, not a multiple of ``every``) saves that step.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from incluster import CheckpointError
from incluster.integrations.lightning import INCLUSTER, InclusterCheckpoint, InclusterDDPStrategy


class Tiny(pl.LightningModule):
    def __init__(self, batch_size: int = 4, stateful: bool = False, grow: bool = False, flat: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.batch_size, self.stateful, self.grow, self.flat = batch_size, stateful, grow, flat
        self.seen: list[list[float]] = []  # (epoch, sum of the batch's inputs) of every batch trained

    def on_train_batch_start(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.seen.append([self.current_epoch, round(float(batch[0].sum()), 5)])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.flat:  # a metric that never improves: EarlyStopping(patience=0) stops at the 2nd epoch's end
            self.log("flat", 1.0, on_step=False, on_epoch=True)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 4, generator=g)
        data = TensorDataset(x, x.sum(1, keepdim=True))
        if self.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            size = self.batch_size * 2 if self.grow and self.current_epoch > 0 else self.batch_size
            return StatefulDataLoader(data, batch_size=size)
        return DataLoader(data, batch_size=self.batch_size)


class Crash(pl.Callback):
    """Ends the fit with an exception once step ``at``'s save is durable."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.at:
            trainer.strategy.incluster_last_save.wait(60)
            raise RuntimeError("crash")


def fit(max_steps: int, ckpt_path: str | None, job: str = "accumulate", every: int = 3, save_last: bool = True,
        max_epochs: int | None = None, accumulate: int = 2, crash_at: int | None = None,
        ck: dict[str, object] | None = None, early: bool = False, **data: object) -> list[object]:
    strategy = InclusterDDPStrategy(checkpointer=dict(job=job, writer="thread", **(ck or {})))
    stop = [pl.callbacks.EarlyStopping("flat", patience=0, check_on_train_epoch_end=True)] if early else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, max_epochs=max_epochs,
        accumulate_grad_batches=accumulate, reload_dataloaders_every_n_epochs=1 if data.get("grow") else 0,
        callbacks=[InclusterCheckpoint(every_n_steps=every, save_last=save_last)]
        + ([Crash(crash_at)] if crash_at is not None else []) + stop, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = Tiny(flat=early, **data)  # type: ignore[arg-type]
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except CheckpointError as e:
        return ["refused", str(e)]
    except RuntimeError as e:
        if str(e) != "crash":
            raise
    return [trainer.global_step, strategy.incluster_restored_step, model.seen]


def main() -> None:
    res = {"first": fit(6, None), "second": fit(9, INCLUSTER), "last": fit(10, INCLUSTER),
           "after_last": fit(10, INCLUSTER)}
    # 16 batches of 4 per epoch (shuffled per epoch by Lightning's DistributedSampler), 2 per step.
    res["ref"] = fit(10, None, "ref", stateful=True)
    res["bs_first"] = fit(5, None, "batch", stateful=True)  # saved at the end of fit, 10 batches in
    res["bs_other"] = fit(7, INCLUSTER, "batch", stateful=True, batch_size=8)
    res["bs_same"] = fit(10, INCLUSTER, "batch", stateful=True)
    res["epoch_end"] = fit(9, None, "epoch-end", every=4, save_last=False, stateful=True)  # 8: the last batch
    res["epoch_end_resumed"] = fit(10, INCLUSTER, "epoch-end", stateful=True)
    # batches of 4 in epoch 0 (8 steps), of 8 from epoch 1 on (a loader made again each
    # epoch): step 9 is saved 2 batches into epoch 1, with batches of 8
    res["grow_first"] = fit(9, None, "grow", stateful=True, grow=True)
    res["grow_resumed"] = fit(11, INCLUSTER, "grow", stateful=True, grow=True)
    # 16 batches of 4 per epoch, one step each; saved every 6 steps and at the end of a fit
    epochs = dict(every=6, max_epochs=3, accumulate=1, stateful=True)
    res["epochs_ref"] = fit(-1, None, "epochs-ref", **epochs)
    res["epochs_one"] = fit(-1, None, "epochs", **{**epochs, "max_epochs": 1})  # 16: epoch 0's last batch
    res["epochs_crash"] = fit(-1, INCLUSTER, "epochs", crash_at=30, **epochs)  # 30: 14 batches into epoch 1
    res["epochs_resumed"] = fit(-1, INCLUSTER, "epochs", **epochs)
    res["epochs_behind"] = fit(-1, None, "epochs", **epochs)  # no ckpt_path: its first save would be refused
    # With a persistent tier uploading only the run's first save (3), the fit's last (10) goes there too
    res["tiered"] = fit(10, None, "tiered", ck=dict(persistent=sys.argv[2], persistent_every=100))
    # EarlyStopping ends the fit at the 2nd epoch's end, step 16 (8 steps an epoch), not a multiple of 3
    res["early"] = fit(-1, None, "early", max_epochs=5, early=True)
    res["early_resumed"] = fit(-1, INCLUSTER, "early", max_epochs=5, early=True)
    # ... and saved every 4 steps, so step 16 is saved as a scheduled one, before the stop is known:
    # with a persistent tier whose schedule uploads the first save only, close() uploads it
    res["early_tier"] = fit(-1, None, "early-tier", max_epochs=5, early=True, every=4,
                            ck=dict(persistent=sys.argv[2], persistent_every=100))
    with open(sys.argv[1], "w") as f:
        json.dump(res, f)
    if torch.distributed.is_initialized():  # a gloo group alive at interpreter exit can abort it
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
