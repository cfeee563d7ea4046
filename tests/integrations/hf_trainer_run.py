"""One process of a tiny transformers Trainer run that checkpoints into incluster (run by
test_transformers).

    hf_trainer_run.py OUT_DIR LOCAL_DIR JOB MODE
    MODE: "full"   - train(resume_from_checkpoint=True) on a job with no step yet: from
                     scratch to the end;
          "crash"  - the same, waiting at step CRASH_FROM until its save is durable; the
                     caller sets INCLUSTER_FAULTS to SIGKILL the process while a later save
                     is half written (so the newest step on disk is incomplete);
          "resume" - train(resume_from_checkpoint=True) in a fresh process;
          "mismatch" - the same with another gradient accumulation (must be refused).

Writes OUT_DIR/<job>-<mode>.json (log history, the step restored) and .pt (final weights).
A tiny GPT-2 built from a config (no download), a fixed synthetic dataset, dropout on (so
the RNG states matter), CPU, one process.
"""

from __future__ import annotations

import json
import os
import sys

import torch

torch.set_num_threads(1)

from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

import incluster  # noqa: E402
from incluster.integrations.transformers import InclusterTrainer  # noqa: E402

CRASH_FROM = 4  # epoch 1, 2 of its 6 batches taken: a mid-epoch resume with skipped batches


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class WaitDurable(TrainerCallback):
    """After the save at CRASH_FROM: wait until it is durable (then the fault may fire)."""

    def __init__(self, trainer: object) -> None:
        self.trainer = trainer

    def on_save(self, args: object, state: object, control: object, **kw: object) -> None:
        handle = self.trainer.incluster_handle  # type: ignore[attr-defined]
        if handle.step == CRASH_FROM:
            handle.durable.result(timeout=60)


def main() -> None:
    out, local_dir, job, mode = sys.argv[1:5]
    ckpt = incluster.Checkpointer(local_dir=local_dir, job=job, writer="thread")
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=os.path.join(out, f"hf-{job}-{mode}"),
        use_cpu=True,
        per_device_train_batch_size=4,  # 6 batches per epoch
        gradient_accumulation_steps=3 if mode == "mismatch" else 2,  # 3 optimizer steps per epoch
        num_train_epochs=3,  # 9 steps
        learning_rate=3e-3,
        warmup_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=7,
        dataloader_num_workers=0,
    )
    trainer = InclusterTrainer(model=model, args=args, train_dataset=Tokens(), checkpointer=ckpt)
    if mode == "crash":
        trainer.add_callback(WaitDurable(trainer))
    trainer.train(resume_from_checkpoint=None if mode == "crash" else True)
    ckpt.close()
    with open(os.path.join(out, f"{job}-{mode}.json"), "w") as f:
        json.dump({"log_history": trainer.state.log_history, "resumed": trainer.incluster_resumed_step,
                   "restore_step": ckpt.last_restore.step if ckpt.last_restore else None}, f)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"{job}-{mode}.pt"))


if __name__ == "__main__":
    main()
