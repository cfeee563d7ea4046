"""One rank of a tiny torchtitan-style job on CPU (gloo), for tests/integrations/test_torchtitan.py.

torchtitan 0.3.0's ``Trainer`` cannot run on a CPU-only machine: importing
``torchtitan.trainer`` (and every ``torchtitan.models`` model) imports ``triton``, and the
trainer selects a CUDA device when no accelerator is present. So this script runs
``Trainer.train()``'s sequence itself with torchtitan's real parts: the config is parsed
by torchtitan's ``ConfigManager`` (tyro; ``--module torchtitan_train --config tiny...``) and
its ``--override.imports`` are applied as ``Trainer.__init__`` does; the model (a small
causal LM, sharded with FSDP2 on gloo as torchtitan shards it) is trained through
torchtitan's ``OptimizersContainer``, ``LRSchedulersContainer``, ``CrossEntropyLoss``,
``clip_grad_norm_`` and ``ParallelAwareDataloader``, and the checkpoint manager is built
with ``config.checkpoint.build(...)`` and the trainer's exact arguments.

Writes ``$TT_OUT/rank-<r>.json`` (losses per step, what was loaded) and ``rank-<r>.pt``
(this rank's final parameter and optimizer shards). ``TT_KILL_AT=<step>``: after that
step's optimizer step, wait until the newest save is durable, report, and SIGKILL itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw
from torchtitan.config import ConfigManager, Configurable, TrainingConfig
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.distributed import utils as dist_utils

VOCAB, DIM = 64, 32


class TinyJob(Configurable):
    """The fields of torchtitan's ``Trainer.Config`` this job uses, declared the same way."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        hf_assets_path: str = "."
        dump_folder: str = "./outputs"
        init_seed: int = 0
        """Seed of the model's initial weights (a seed checkpoint uses another one)."""
        optimizer: OptimizersContainer.Config = field(default_factory=OptimizersContainer.Config)
        lr_scheduler: LRSchedulersContainer.Config = field(default_factory=LRSchedulersContainer.Config)
        training: TrainingConfig = field(default_factory=TrainingConfig)
        checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)
        override: OverrideConfig = field(default_factory=OverrideConfig)


def tiny() -> TinyJob.Config:
    """A config as torchtitan's config_registry functions write them (stock DCP manager)."""
    optimizer = default_adamw(lr=1e-2)
    optimizer.implementation = "foreach"
    return TinyJob.Config(
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8),
        training=TrainingConfig(local_batch_size=2, seq_len=16, steps=8, max_norm=1.0),
        checkpoint=CheckpointManager.Config(interval=3),
    )


def tiny_incluster() -> TinyJob.Config:
    """The same job with incluster chosen in the config function itself."""
    from incluster.integrations.torchtitan import InclusterCheckpointManager

    config = tiny()
    config.checkpoint = InclusterCheckpointManager.Config(interval=3, replicas=0)
    return config


class TokenStream(IterableDataset):  # type: ignore[type-arg]
    """Synthetic token sequences, a different stream per data-parallel rank; Stateful."""

    def __init__(self, rank: int, seq_len: int) -> None:
        self.rank, self.seq_len, self.index = rank, seq_len, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(100_000 * self.rank + self.index)
            self.index += 1
            tokens = torch.randint(0, VOCAB, (self.seq_len + 1,), generator=g)
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = state["index"]


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layer = torch.nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
        self.output = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.output(self.layer(self.tok_embeddings(tokens), src_mask=mask, is_causal=True))


class TrainState:
    """``Trainer``'s own Stateful part, checkpointed as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def full_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.full_tensor() if isinstance(p, DTensor) else p  # collective on every rank
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local(t: Any) -> Any:
    return t.to_local().clone() if isinstance(t, DTensor) else t.clone() if isinstance(t, torch.Tensor) else t


def main() -> None:
    config: Any = ConfigManager().parse_args()
    dist.init_process_group("gloo")
    apply_overrides(config.override, config)  # as Trainer.__init__ does, before building anything
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.init_seed)
    model = TinyLM()
    seed_run = config.checkpoint.create_seed_checkpoint
    if world > 1 and not seed_run:  # a seed checkpoint is written unsharded, as torchtitan does
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    dataloader = ParallelAwareDataloader(
        TokenStream(rank, config.training.seq_len), dp_rank=rank, dp_world_size=world,
        batch_size=config.training.local_batch_size,
    )
    train_state = TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=config.dump_folder,
    )
    out = os.environ["TT_OUT"]
    report: dict[str, Any] = {"manager": type(checkpointer).__name__, "losses": {}}

    def write() -> None:
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)

    if seed_run:  # train.py's branch: save(curr_step=0, last_step=True) instead of training
        checkpointer.save(curr_step=0, last_step=True)
        report["digest"] = full_digest(model)
        write()
        checkpointer.close()
        dist.destroy_process_group()
        return

    # Trainer.train(): load, then per step the trainer's calls in the trainer's order.
    checkpointer.load(step=config.checkpoint.load_step)
    report.update(loaded_step=train_state.step, digest=full_digest(model),
                  loaded_from=getattr(checkpointer, "loaded_from", None))
    loss_fn = CrossEntropyLoss.Config().build()
    kill_at = int(os.environ.get("TT_KILL_AT", "0"))
    data = iter(dataloader)
    while train_state.step < config.training.steps:
        train_state.step += 1
        optimizers.zero_grad()
        input_dict, labels = next(data)
        train_state.ntokens_seen += labels.numel()
        global_valid_tokens = torch.tensor(labels.numel() * world)
        pred = model(input_dict["input"])
        loss, _ = loss_fn(pred, labels, global_valid_tokens)
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        report["losses"][train_state.step] = loss.item()
        if train_state.step == kill_at:
            checkpointer.last_save.wait()  # the newest save is durable: a restart finds it
            report["killed_after_durable"] = checkpointer.last_save.step
            write()
            # Both ranks have heard the save is durable before either dies: one killed first
            # takes the job's store with it, and a peer still waiting to hear would fail instead.
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        checkpointer.save(train_state.step, last_step=(train_state.step == config.training.steps))

    report["ntokens_seen"] = train_state.ntokens_seen
    report["lr_last_epoch"] = lr_schedulers.schedulers[0].last_epoch
    torch.save(
        {"model": {k: local(v) for k, v in model.state_dict().items()},
         "optimizer": {k: local(v) for k, v in optimizers.state_dict().items()}},
        os.path.join(out, f"rank-{rank}.pt"),
    )
    write()
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.modules.setdefault("torchtitan_train", sys.modules["__main__"])  # --module torchtitan_train
    main()
