"""Train a tiny GPT-2 with the transformers Trainer, checkpointing into incluster.

The same command starts the job and resumes it after any crash (from the newest step the
cluster still holds, never a half-written one):

    python examples/hf_trainer_incluster.py --job demo-trainer --steps 60 --save-steps 10
    # kill it (Ctrl-C, SIGKILL, a lost node) and run the same command again

With torchrun (DDP) each rank saves its own state into its node's RAM disk
(INCLUSTER_LOCAL_DIR, default /dev/shm/incluster). The model is built from a config in
code and trained on synthetic tokens: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import incluster
from incluster.integrations.transformers import InclusterTrainer


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (the model learns their unigram statistics)."""

    def __init__(self, n: int = 512, length: int = 32, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="hf-trainer-example")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--output-dir", default="/tmp/hf-trainer-incluster")
    p.add_argument("--persistent", default=None, help="path or fsspec URL for every 5th checkpoint")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        save_strategy="steps",
        save_steps=a.save_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=5,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    ckpt = incluster.Checkpointer(job=a.job, persistent=a.persistent,
                                  persistent_every=5 if a.persistent else None)
    torch.manual_seed(0)  # the same initial model in every run: a resumed run matches an uninterrupted one bitwise
    trainer = InclusterTrainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(), checkpointer=ckpt)
    trainer.train(resume_from_checkpoint=True)  # newest complete step, or from scratch
    print(f"resumed from step {trainer.incluster_resumed_step}; finished at step {trainer.state.global_step}")
    ckpt.close()
    trainer.save_model()  # the final model, as usual


if __name__ == "__main__":
    main()
