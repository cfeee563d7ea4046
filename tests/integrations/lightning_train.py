"""One rank of a tiny Lightning DDP run that saves through incluster (run by test_lightning).

    lightning_train.py OUT_DIR LOCAL_DIR MODE
    MODE: "reference+crash" - a full run (job "ref"), then a run (job "crash") that SIGKILLs
          itself once its save at CRASH_STEP is durable; "resume" - resumes job "crash".

The caller starts every rank (LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), as a
launcher like torchrun does. Each fit writes OUT_DIR/<job>-rank<r>.json: the loss of every
optimizer step it ran, the final parameters, the step it restored.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import pytorch_lightning as pl
from incluster.integrations.lightning import (
    INCLUSTER,
    InclusterCheckpoint,
    InclusterDDPStrategy,
    InclusterModelParallelStrategy,
)

MAX_STEPS = 20  # 8 batches per rank and epoch: ends in the third epoch
EVERY = 3
CRASH_STEP = 12  # epoch 1, after its 4th batch: a mid-epoch resume
WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown unsets it
STRATEGY = os.environ.get("STRATEGY", "ddp")  # "ddp", or "model_parallel" (FSDP2 over the ranks)


class Tiny(pl.LightningModule):
    def __init__(self, crash_at: int | None) -> None:
        super().__init__()
        self.save_hyperparameters({"width": 8, "lr": 0.05})
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1)
        )
        self.crash_at = crash_at
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if STRATEGY == "model_parallel":  # each rank keeps a shard of every parameter (DTensors)
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()  # the optimizer step this loss drives
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.global_step == self.crash_at:  # callbacks (the save) ran first
            handle = self.trainer.strategy.incluster_last_save
            assert handle is not None and handle.step == self.crash_at
            handle.durable.result(timeout=60)
            # Every rank's handle has resolved (rank 0 hosts the job store the others read).
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> StatefulDataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 4, generator=g)
        y = x.sum(1, keepdim=True).sin()
        data = TensorDataset(x, y)
        # Deterministic: shuffled by (seed, epoch); Lightning calls set_epoch every epoch.
        sampler = DistributedSampler(data, num_replicas=WORLD_SIZE, rank=self.global_rank, shuffle=True, seed=0)
        return StatefulDataLoader(data, batch_size=4, sampler=sampler)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fit(out_dir: str, local_dir: str, job: str, crash_at: int | None, ckpt_path: str | None) -> None:
    pl.seed_everything(0, verbose=False)
    model = Tiny(crash_at)
    options = dict(local_dir=local_dir, job=job, replicas=0)
    if STRATEGY == "model_parallel":
        strategy = InclusterModelParallelStrategy(checkpointer=options, data_parallel_size=WORLD_SIZE,
                                                  tensor_parallel_size=1)
    else:
        strategy = InclusterDDPStrategy(checkpointer=options, process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=MAX_STEPS,
        # The reference run does not save: saving must not change what training computes.
        callbacks=[] if job == "ref" else [InclusterCheckpoint(every_n_steps=EVERY)], logger=False, enable_checkpointing=False, use_distributed_sampler=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    out = {
        "losses": {str(k): v for k, v in sorted(model.losses.items())},
        "params": {k: _full(v).flatten().tolist() for k, v in model.state_dict().items()},
        "restored": strategy.incluster_restored_step,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }
    with open(os.path.join(out_dir, f"{job}-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(out, f)


def main() -> None:
    out_dir, local_dir, mode = sys.argv[1:4]
    faulthandler.enable()  # an abort shows where every thread was
    faulthandler.dump_traceback_later(70, exit=False)  # a hang shows every thread in the log
    if mode == "reference+crash":
        fit(out_dir, local_dir, "ref", None, None)
        fit(out_dir, local_dir, "crash", CRASH_STEP, INCLUSTER)  # nothing saved yet: starts fresh
    else:
        fit(out_dir, local_dir, "crash", None, INCLUSTER)
    # Lightning leaves its process group alive; a gloo group still alive at interpreter exit can
    # abort the process ("terminate called without an active exception", exit -6).
    torch.distributed.destroy_process_group()
    # Even so, once in a loaded run (model_parallel, after the fit and its results were written)
    # a rank aborted the same way in the C++ teardown after Python had finished: the results
    # are written and checked, so the process ends here, without the native teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
