"""torchtitan: its DCP ``CheckpointManager`` with interval saves and restarts going through
incluster (the node's RAM, copies on other nodes, a persistent tier every Nth save).

Turn it on from the command line of any torchtitan config::

    --checkpoint.enable --checkpoint.interval 100 \\
    --override.imports 'incluster.integrations.torchtitan.use_incluster={"persistent": "s3://b/run"}'

or in a ``config_registry`` function: ``checkpoint=InclusterCheckpointManager.Config(enable=True,
interval=100, replicas=1, persistent="s3://b/run")`` (then ``--checkpoint.replicas`` etc. work
on the command line too).

How torchtitan's calls map (``Trainer.train`` makes them, in this order):

- ``load(step=-1)`` at start: a collective incluster ``load()`` of the states torchtitan
  checkpoints (model parts through ``ModelWrapper``, optimizers, LR schedulers, data loader,
  ``train_state`` and any other ``states``), minus ``exclude_from_loading``. When incluster
  holds no step, torchtitan's own load runs unchanged: its checkpoint folder, then
  ``initial_load_path`` (DCP or Hugging Face safetensors), then a fresh start. An explicit
  ``load_step`` names a DCP step folder and goes to torchtitan's load directly.
- ``maybe_wait_for_staging()`` (right before ``optimizers.step()``): waits until the save in
  flight is copied out (every optimizer step waits for that anyway: incluster's step hook).
- ``save(curr_step, last_step)``: torchtitan's policy decides (``interval``,
  ``enable_first_step_checkpoint``, ``load_only``, ``last_step``); a due save goes to
  incluster and returns in about a millisecond. Step 0 (``create_seed_checkpoint``) is a DCP
  artifact for other jobs and stays DCP. At the last step the full state also goes to
  incluster, and torchtitan's final model-only export (``last_save_model_only``,
  ``last_save_in_hf``, ``export_dtype``) is written to the checkpoint folder as before.
- ``close()``: drains the saves and uploads in flight, then torchtitan's own close.
"""

from __future__ import annotations

import dataclasses

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

try:
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.config.override import derive, override
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"incluster.integrations.torchtitan needs torchtitan (tested with 0.3.0): pip install torchtitan ({exc})"
    ) from exc

from incluster import Checkpointer
from incluster.handle import SaveHandle
from incluster.integrations.torchtitan_state import incluster_states

__all__ = ["InclusterCheckpointManager", "use_incluster"]

log = logging.getLogger(__name__)


class InclusterCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose interval saves and restarts use incluster.

    Built by torchtitan exactly like the manager it replaces (``config.checkpoint.build(...)``
    in ``Trainer.__init__``). The ``incluster.Checkpointer`` is created on first use, after
    the process group exists; :attr:`incluster` gives it, :attr:`last_save` the newest
    save's handle (``last_save.wait()``: durable, a restart will find it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint options plus where incluster keeps the checkpoints."""

        local_dir: str | None = None
        """Tier 0: this node's RAM-disk folder (default: INCLUSTER_LOCAL_DIR, else /dev/shm/incluster)."""

        replicas: int = 1
        """Tier 1: copies of each rank's shard kept in other nodes' RAM (0: none)."""

        persistent: str | None = None
        """Tier 2: a path or fsspec URL (s3://bucket/run, /mnt/ckpt); None: off (INCLUSTER_PERSISTENT)."""

        persistent_every: int | None = None
        """Every Nth incluster checkpoint also goes to the persistent tier (None: 10)."""

        job: str | None = None
        """Name of this job's checkpoints (default: INCLUSTER_JOB, else torchrun's run id);
        a restarted job must use the same name to find them."""

        allow_pickle: bool = False
        """Store state values that are neither tensors nor JSON with pickle (loading runs code)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if not isinstance(self.replicas, int) or self.replicas < 0:
                raise ValueError(f"checkpoint.replicas must be an integer >= 0 (got {self.replicas!r})")
            if self.persistent_every is not None and (not isinstance(self.persistent_every, int)
                                                      or self.persistent_every < 1):
                raise ValueError(
                    f"checkpoint.persistent_every must be an integer >= 1 (got {self.persistent_every!r})"
                )
            for name in ("local_dir", "persistent", "job"):
                value = getattr(self, name)
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"checkpoint.{name} must be a string (got {type(value).__name__} {value!r})")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self._incluster: Checkpointer | None = None
        self._closed = False
        self.last_save: SaveHandle | None = None
        """The newest incluster save (``None`` before the first)."""
        self.loaded_from: str | None = None
        """Where ``load()`` found the state: ``"incluster"``, ``"dcp"`` or ``None`` (fresh start)."""
        super().__init__(config, **kwargs)  # dataloader, model_parts, optimizers, ... as torchtitan passes them
        self._options = {
            "local_dir": config.local_dir,
            "replicas": config.replicas,
            "persistent": config.persistent,
            "persistent_every": config.persistent_every,
            "job": config.job,
            "allow_pickle": config.allow_pickle,
        }

    def __del__(self) -> None:
        # At interpreter exit the thread pools that close() drains through are gone (and the
        # writer processes end with this one): only an explicit close() drains.
        if not sys.is_finalizing():
            self.close()

    @property
    def incluster(self) -> Checkpointer:
        """This rank's ``incluster.Checkpointer`` (created on first use: collective)."""
        if self._incluster is None:
            if self._closed:
                raise RuntimeError("this checkpoint manager is closed; build a new one")
            self._incluster = Checkpointer(**self._options)
            self._incluster.persist_last = True  # the run's last step outlives the nodes: catch_up.py
        return self._incluster

    # -- torchtitan's hooks ---------------------------------------------------------------
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            return bool(super()._load(step))  # --checkpoint.load_step names a DCP step folder
        begin = time.monotonic()
        states = incluster_states(self.states, exclude=self.exclude_from_loading)
        restored = self.incluster.load(states)
        if restored is None:
            found = bool(super()._load(step))  # seed checkpoint, initial_load_path, HF weights
            self.loaded_from = "dcp" if found else None
            return found
        # As torchtitan's own load does: the model parts take the flat dict, so tensors that
        # state-dict hooks produce (not the parameters' own storage) reach the model too.
        self.states[MODEL].load_state_dict(states)
        self.loaded_from = "incluster"
        log.info("incluster: restored step %d in %.2f s", restored, time.monotonic() - begin)
        return True

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if curr_step == 0:
            return bool(super()._save(curr_step, last_step))  # a seed checkpoint: DCP, for other jobs
        # The run's last step outlives the job's nodes only in the persistent tier: it goes there too.
        persist = True if last_step and self.incluster.config.persistent is not None else None
        self.last_save = self.incluster.save(curr_step, incluster_states(self.states), persist=persist)
        if last_step and self.last_save_model_only:
            # torchtitan's final artifact (model only, export_dtype, DCP or HF safetensors);
            # the full state of the last step is in incluster for a run that goes on.
            self._save_last_step(curr_step)
        return True

    def _maybe_wait_for_staging(self) -> None:
        super()._maybe_wait_for_staging()
        if self._incluster is not None:
            self._incluster.wait_staged()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._incluster is not None:
                self._incluster.close()  # drains the saves and uploads in flight
        finally:
            super()._close()


@override(
    target=CheckpointManager.Config,
    exact=True,
    description="incluster: interval checkpoints in the cluster's RAM, replicated, persisted every Nth",
)
def use_incluster(config: CheckpointManager.Config, **options: Any) -> InclusterCheckpointManager.Config:
    """torchtitan override: replace the checkpoint config by the incluster one, keeping
    every torchtitan option; ``options`` set the incluster ones, e.g.
    ``--override.imports 'incluster.integrations.torchtitan.use_incluster={"replicas": 1}'``."""
    known = {f.name for f in dataclasses.fields(InclusterCheckpointManager.Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        ours = ", ".join(sorted(known - {f.name for f in dataclasses.fields(CheckpointManager.Config)}))
        raise ValueError(f"use_incluster got unknown option(s) {unknown}: the incluster ones are {ours} (and every "
                         f"torchtitan checkpoint option)")
    return derive(config, InclusterCheckpointManager.Config, **options)
