"""torchtitan 0.3.0: the incluster checkpoint manager, turned on from torchtitan's own config
and command line, saves on torchtitan's interval, survives a SIGKILL and resumes bitwise.

torchtitan's ``Trainer`` cannot run on a CPU-only machine (importing it needs ``triton``,
and it picks a CUDA device), so ``torchtitan_train.py`` runs the trainer's call sequence
with torchtitan's real config parser and overrides, optimizer / LR scheduler containers,
loss, gradient clipping, data loader and FSDP2 sharding, on 2 ranks over gloo.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from incluster.config import resolve
from incluster.state import flatten
from incluster.errors import CheckpointError
from incluster.testing.launch import Job, launch
from integrations.conftest import require

HERE = os.path.dirname(__file__)
ARGV = [os.path.join(HERE, "torchtitan_train.py"), "--module", "torchtitan_train"]


def start(base: str, name: str, nodes: list[str], args: list[str], ram: str = "", **env: str) -> Job:
    """Launch ``name``: one rank per node, each node's RAM folder under ``ram-<ram or name>``."""
    out = os.path.join(base, name)
    os.makedirs(out)
    ram_dir = os.path.join(base, "ram-" + (ram or name))
    return launch([*ARGV, *args], nodes=nodes, ranks_per_node=1, base_dir=ram_dir, env={"TT_OUT": out, **env})


def finish(job: Job, codes: list[int], timeout: float = 120) -> None:
    got = job.wait(timeout)
    assert got == codes, "\n".join(job.output(r)[-3000:] for r in range(len(job.procs)))


def reports(base: str, name: str, world: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        with open(os.path.join(base, name, f"rank-{r}.json")) as f:
            out.append(json.load(f))
    return out


def steps_in(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.mark.multiproc
def test_sigkill_after_durable_save_resumes_bitwise(local_dir: str) -> None:
    require("torchtitan", "torchtitan.components.checkpoint")
    base = local_dir
    # A seed checkpoint (torchtitan's create_seed_checkpoint: DCP, step 0, other weights).
    seed = start(base, "seed", ["n0"], [
        "--config", "tiny", "--dump_folder", f"{base}/seed", "--init_seed", "7", "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--override.imports", "incluster.integrations.torchtitan.use_incluster",
    ])
    finish(seed, [0])
    seed_path = f"{base}/seed/checkpoint/step-0"
    assert os.path.exists(f"{seed_path}/.metadata")  # step 0 stays a DCP artifact

    nodes = ["n0", "n1"]
    # Reference: incluster chosen in the config function, its options set on the command line.
    ref_args = ["--config", "tiny_incluster", "--dump_folder", f"{base}/ref", "--checkpoint.enable",
                "--checkpoint.initial_load_path", seed_path, "--checkpoint.job", "tt-ref",
                "--checkpoint.replicas", "1", "--checkpoint.persistent", f"{base}/tier",
                "--checkpoint.persistent_every", "100"]  # the tier's schedule: the first save only
    # The crashed job: the stock config, incluster turned on with torchtitan's override flag.
    crash_args = ["--config", "tiny", "--dump_folder", f"{base}/crash", "--checkpoint.enable",
                  "--checkpoint.initial_load_path", seed_path,
                  "--override.imports",
                  'incluster.integrations.torchtitan.use_incluster={"job": "tt-crash", "replicas": 1}']
    ref = start(base, "ref", nodes, ref_args)
    crash = start(base, "crash", nodes, crash_args, TT_KILL_AT="7")  # killed in step 7, after save 6 is durable
    finish(ref, [0, 0])
    # Each rank SIGKILLs itself in step 7; one killed first may leave the other failing on the
    # lost store or group (exit 1) before it reaches its own kill: either way, a crash.
    got = crash.wait(120)
    assert -9 in got and all(c in (-9, 1) for c in got), "\n".join(crash.output(r)[-3000:] for r in range(2))
    resume = start(base, "resume", nodes, crash_args, ram="crash")  # fresh processes, the crashed job's RAM
    finish(resume, [0, 0])

    seed_digest = reports(base, "seed", 1)[0]["digest"]
    refs, crashed, resumed = (reports(base, n, 2) for n in ("ref", "crash", "resume"))
    for rank in range(2):
        r, c, s = refs[rank], crashed[rank], resumed[rank]
        assert r["manager"] == c["manager"] == s["manager"] == "InclusterCheckpointManager"
        # Nothing in incluster yet: torchtitan's own load of initial_load_path ran.
        assert r["loaded_from"] == c["loaded_from"] == "dcp" and r["digest"] == c["digest"] == seed_digest
        assert c["killed_after_durable"] == 6
        assert c["losses"] == {k: v for k, v in r["losses"].items() if int(k) <= 7}
        # The restart loads step 6 from incluster, although a DCP seed is configured too.
        assert s["loaded_from"] == "incluster" and s["loaded_step"] == 6
        assert s["losses"] == {k: v for k, v in r["losses"].items() if int(k) > 6}, (s["losses"], r["losses"])
        assert (s["ntokens_seen"], s["lr_last_epoch"]) == (r["ntokens_seen"], r["lr_last_epoch"]) == (256, 8)
        a = torch.load(os.path.join(base, "ref", f"rank-{rank}.pt"))
        b = torch.load(os.path.join(base, "resume", f"rank-{rank}.pt"))
        for part in ("model", "optimizer"):
            assert a[part].keys() == b[part].keys()
            for key, want in a[part].items():
                got = b[part][key]
                assert torch.equal(got, want) if torch.is_tensor(want) else got == want, f"{part}/{key}"
    # Interval saves went to incluster only; the last step wrote torchtitan's model-only export.
    assert steps_in(f"{base}/crash/checkpoint") == ["step-8"] and steps_in(f"{base}/ref/checkpoint") == ["step-8"]
    # The run's last step went to the persistent tier too, whatever its schedule.
    assert os.path.exists(f"{base}/tier/tt-ref/step-000000000008/COMMITTED.json"), os.listdir(f"{base}/tier/tt-ref")


def test_config_override_and_validation(caplog: pytest.LogCaptureFixture) -> None:
    require("torchtitan", "torchtitan.components.checkpoint")
    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
    from torchtitan.config import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from incluster.integrations.torchtitan import InclusterCheckpointManager

    @dataclass(kw_only=True, slots=True)
    class Root(Configurable.Config):  # the field exactly as torchtitan's Trainer.Config declares it
        checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)

    root = Root(checkpoint=CheckpointManager.Config(enable=True, interval=7, keep_latest_k=3))
    from torchtitan.config.override import parse_cli_imports

    imports = ['incluster.integrations.torchtitan.use_incluster={"persistent": "/tmp/p", "persistent_every": 4}']
    apply_overrides(OverrideConfig(imports=parse_cli_imports(imports)), root)  # as Trainer.__init__ does
    cfg = root.checkpoint
    assert type(cfg) is InclusterCheckpointManager.Config
    assert (cfg.enable, cfg.interval, cfg.keep_latest_k) == (True, 7, 3)  # torchtitan's options kept
    assert (cfg.persistent, cfg.persistent_every, cfg.replicas) == ("/tmp/p", 4, 1)
    assert cfg._owner is InclusterCheckpointManager  # config.checkpoint.build(...) makes the manager

    # Left at their defaults, the tier's options say nothing of a tier the run does not have
    # (a default persistent_every warned "given, but there is no persistent tier" on every launch).
    plain = InclusterCheckpointManager.Config()
    with caplog.at_level(logging.WARNING, logger="incluster"):
        resolve(local_dir="/dev/shm", job="tt", persistent=plain.persistent, persistent_every=plain.persistent_every)
    assert not [r for r in caplog.records if "no persistent tier" in r.getMessage()]
    with pytest.raises(ValueError, match="replicas"):
        InclusterCheckpointManager.Config(replicas=-1)
    with pytest.raises(ValueError, match="persistent_every"):
        InclusterCheckpointManager.Config(persistent_every=0)
    with pytest.raises(ValueError, match="interval"):
        InclusterCheckpointManager.Config(interval=0)  # torchtitan's own checks still run
    with pytest.raises(ValueError, match="checkpoint.job must be a string"):
        InclusterCheckpointManager.Config(job=7)  # a JSON override's number, never a folder name "7" by surprise
    typo = ['incluster.integrations.torchtitan.use_incluster={"persistant": "/tmp/p"}']
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['persistant'\]: the incluster ones are .*persistent,"):
        apply_overrides(OverrideConfig(imports=parse_cli_imports(typo)), Root())


def test_dataloader_state_needs_no_pickle() -> None:
    require("torchtitan", "torchtitan.components.dataloader")
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from incluster.integrations.torchtitan_state import DataloaderState
    from integrations.torchtitan_train import TokenStream

    def loader(world: int = 2) -> Any:
        return ParallelAwareDataloader(TokenStream(1, 8), dp_rank=1, dp_world_size=world, batch_size=2)

    dl = loader()
    it = iter(dl)
    for _ in range(3):
        next(it)
    with pytest.raises(CheckpointError, match="allow_pickle"):
        flatten({"dataloader": dl})  # torchtitan's own state_dict() holds pickled bytes
    state = DataloaderState(dl).state_dict()
    assert flatten({"dataloader": DataloaderState(dl)}).tree  # a plain tree: no pickle
    want = next(it)

    fresh = loader()
    DataloaderState(fresh).load_state_dict(json.loads(json.dumps(state)))
    got = next(iter(fresh))
    assert torch.equal(got[0]["input"], want[0]["input"]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="data-parallel"):
        DataloaderState(loader(world=4)).load_state_dict(state)
