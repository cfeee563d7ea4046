"""torchtitan (0.3.0) with in-cluster checkpoints: a config_registry module.

Two ways to turn incluster on; both leave torchtitan's Trainer and training loop as they are.

1. No code at all, any existing torchtitan config (flags added to the usual launch):

    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m torchtitan.train --module llama3 --config llama3_8b \\
        --checkpoint.enable --checkpoint.interval 50 \\
        --override.imports 'incluster.integrations.torchtitan.use_incluster={"persistent": "s3://bucket/run", "persistent_every": 10}'

2. A config function (this file); its incluster options are then command-line flags too
   (``--checkpoint.replicas``, ``--checkpoint.persistent``, ``--checkpoint.persistent_every``,
   ``--checkpoint.local_dir``, ``--checkpoint.job``):

    PYTHONPATH=examples torchrun ... -m torchtitan.train \\
        --module torchtitan_incluster --config llama3_8b_incluster --checkpoint.persistent s3://bucket/run

Every 50 steps each rank's state goes to its node's RAM disk (INCLUSTER_LOCAL_DIR, default
/dev/shm/incluster) with a copy on another node, and every 10th of those also to the
persistent tier. A restart (same flags) resumes from the newest step any tier still holds;
a job that has none starts as torchtitan would (its checkpoint folder, initial_load_path,
Hugging Face weights). The last step still writes torchtitan's model-only export.
"""

from __future__ import annotations

from torchtitan.config.override import derive
from torchtitan.models.llama3.config_registry import llama3_8b
from torchtitan.trainer import Trainer

from incluster.integrations.torchtitan import InclusterCheckpointManager


def llama3_8b_incluster() -> Trainer.Config:
    """torchtitan's Llama 3 8B config with incluster checkpoints every 50 steps."""
    config = llama3_8b()
    config.checkpoint = derive(
        config.checkpoint,  # keeps every torchtitan checkpoint option (folder, export dtype, ...)
        InclusterCheckpointManager.Config,
        enable=True,
        interval=50,
        replicas=1,
        persistent=None,  # e.g. "s3://bucket/run" or "/mnt/shared/ckpt"; or --checkpoint.persistent
        persistent_every=None,  # with a persistent tier: every Nth save goes there (e.g. 10)
    )
    return config
