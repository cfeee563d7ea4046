"""PyTorch Lightning through incluster: 2 DDP ranks (gloo) save every 3 steps, SIGKILL
themselves once the save of step 12 (mid-epoch) is durable; fresh processes resume with
``trainer.fit(model, ckpt_path="incluster")`` and must match an uninterrupted run bit for
bit: every loss after step 12 (dropout included: each rank's RNG is restored) and the
final parameters. The script is tests/integrations/lightning_train.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from incluster.testing.launch import free_port
from integrations.conftest import require

SCRIPT = os.path.join(os.path.dirname(__file__), "lightning_train.py")
WORLD = 2


def _launch(out_dir: str, local_dir: str, mode: str, strategy: str = "ddp") -> list[subprocess.Popen[bytes]]:
    """Start every rank the way torchrun would (Lightning then runs them as given)."""
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                   LOCAL_RANK=str(rank), NODE_RANK="0", PYTHONWARNINGS="ignore", STRATEGY=strategy)
        log = open(os.path.join(out_dir, f"{mode}-{rank}.log"), "wb")
        procs.append(subprocess.Popen([sys.executable, SCRIPT, out_dir, local_dir, mode], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def _read(out_dir: str, job: str, rank: int) -> dict:
    with open(os.path.join(out_dir, f"{job}-rank{rank}.json")) as f:
        return json.load(f)


def _log_tail(out_dir: str, mode: str) -> str:
    return "\n".join(
        open(os.path.join(out_dir, f"{mode}-{r}.log"), errors="replace").read()[-2000:] for r in range(WORLD)
    )


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_sigkill_mid_epoch_resumes_bitwise(local_dir, tmp_path, strategy):
    require("pytorch-lightning", "pytorch_lightning")
    require("torchdata", "torchdata.stateful_dataloader")
    out = str(tmp_path)

    # A full reference run, then (same processes) a run that SIGKILLs itself after step 12.
    codes = _wait(_launch(out, local_dir, "reference+crash", strategy))
    assert codes == [-signal.SIGKILL] * WORLD, _log_tail(out, "reference+crash")
    time.sleep(0.3)  # the writer processes follow their trainers (parent-death signal)
    for rank in range(WORLD):
        folder = os.path.join(local_dir, "crash", f"rank-{rank:05d}")
        assert os.path.exists(os.path.join(folder, "step-000000000012.json")), (
            sorted(os.listdir(folder)), _log_tail(out, "reference+crash"))

    codes = _wait(_launch(out, local_dir, "resume", strategy))
    assert codes == [0] * WORLD, _log_tail(out, "resume")

    for rank in range(WORLD):
        ref, resumed = _read(out, "ref", rank), _read(out, "crash", rank)
        assert resumed["restored"] == 12
        assert list(resumed["losses"]) == [str(s) for s in range(13, 21)], "resumed at the wrong batch"
        for step, loss in resumed["losses"].items():
            assert loss == ref["losses"][step], f"rank {rank} step {step}: {loss!r} != {ref['losses'][step]!r}"
        assert resumed["params"] == ref["params"], f"rank {rank}: final parameters differ"
        assert (resumed["global_step"], resumed["epoch"]) == (ref["global_step"], ref["epoch"])
    assert _read(out, "ref", 0)["params"] == _read(out, "ref", 1)["params"]  # DDP kept ranks in step


@pytest.mark.timeout(300)
def test_the_callback_saves_at_the_end_of_fit_never_twice_and_refuses_a_resized_mid_epoch_loader(local_dir, tmp_path):
    require("pytorch-lightning", "pytorch_lightning")
    require("torchdata", "torchdata.stateful_dataloader")
    out = str(tmp_path / "acc.json")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", LOCAL_RANK="0",
               NODE_RANK="0", INCLUSTER_LOCAL_DIR=local_dir, PYTHONWARNINGS="ignore")
    tier = str(tmp_path / "tier")
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "lightning_accumulate.py"), out,
                           tier], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(out))
    steps = {k: v[:2] for k, v in res.items() if v[0] != "refused"}
    assert steps["first"] == [6, None] and steps["second"] == [9, 6], steps  # accumulation: 6 not saved again
    assert steps["last"] == [10, 9] and steps["after_last"] == [10, 10], steps  # step 10: saved as fit ended
    ref = res["ref"][2]  # (epoch, batch) of an uninterrupted run: 16 batches of epoch 0, 4 of epoch 1
    assert [e for e, _ in ref] == [0] * 16 + [1] * 4
    refused, why = res["bs_other"]
    assert refused == "refused" and "batch size 4" in why and "now has 8" in why, res
    assert steps["bs_same"] == [10, 5] and res["bs_same"][2] == ref[10:], res["bs_same"]
    # saved on epoch 0's last batch: the resume trains epoch 1's first batches, not epoch 2's
    assert steps["epoch_end"] == [9, None] and steps["epoch_end_resumed"] == [10, 8], steps
    assert res["epoch_end_resumed"][2] == ref[16:], res["epoch_end_resumed"][2]
    assert steps["grow_first"] == [9, None] and steps["grow_resumed"] == [11, 9], res["grow_resumed"]
    # Resumed on an epoch's last batch, Lightning never counted the next epoch as started, so
    # its later saves resumed at that epoch's first batch: trained twice, the fit 14 steps longer.
    ref = res["epochs_ref"][2]
    assert steps["epochs_ref"][0] == 48 and [e for e, _ in ref] == [0] * 16 + [1] * 16 + [2] * 16
    assert steps["epochs_one"] == [16, None] and steps["epochs_crash"] == [30, 16], steps
    assert res["epochs_crash"][2] == ref[16:30]
    assert steps["epochs_resumed"] == [48, 30] and res["epochs_resumed"][2] == ref[30:], res["epochs_resumed"]
    refused, why = res["epochs_behind"]  # refused before training (it used to train 6 steps, then fail to save)
    assert refused == "refused" and "already holds step 48, and this fit starts at step 0" in why, why
    assert 'Pass trainer.fit(..., ckpt_path="incluster")' in why
    assert steps["early"] == [16, None] and steps["early_resumed"][1] == 16, steps  # early-stopped: its step saved
    assert res["tiered"][0] == 10  # the fit's last step reaches the persistent tier whatever its schedule
    assert res["early_tier"][0] == 16 and os.path.exists(os.path.join(tier, "early-tier", "step-000000000016",
                                                                      "COMMITTED.json"))
    assert sorted(n for n in os.listdir(os.path.join(tier, "tiered")) if n.startswith("step-")) == ["step-000000000003", "step-000000000010"]
    assert os.path.exists(os.path.join(tier, "tiered", "step-000000000010", "COMMITTED.json"))


def test_validate_test_and_predict_restore_the_fits_weights_without_warning_of_the_optimizer(local_dir, tmp_path):
    """Evaluations leave the optimizers out on purpose (the strategy asks for the model
    alone); each warned that the checkpoint also holds 'optimizer_0', which a Lightning
    user can do nothing about."""
    require("pytorch-lightning", "pytorch_lightning")
    out = str(tmp_path / "evals.json")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", LOCAL_RANK="0",
               NODE_RANK="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "lightning_eval.py"), out,
                           local_dir], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(out))
    for fn in ("validate", "test", "predict"):
        assert res[fn]["step"] == 6 and res[fn]["bitwise"], (fn, res[fn])
        assert res[fn]["warnings"] == [], (fn, res[fn]["warnings"])
