"""transformers ``Trainer`` through incluster (tests/integrations/hf_trainer_run.py, one CPU
process each): a tiny GPT-2 saves every 2 optimizer steps; a run waits until its save of
step 4 (mid-epoch) is durable and is SIGKILLed while its save of step 6 is half written;
a fresh process resumes with ``train(resume_from_checkpoint=True)`` and must pick step 4
(the incomplete step 6 never), skip the batches step 4 had taken and match an
uninterrupted run bit for bit: every logged loss, gradient norm and learning rate after
step 4 (dropout included: the RNG states are restored), the log history before it (from
the saved TrainerState) and the final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from incluster.testing.faults import FaultInjector
from integrations.conftest import require

SCRIPT = os.path.join(os.path.dirname(__file__), "hf_trainer_run.py")


def _start(out: str, local_dir: str, job: str, mode: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, SCRIPT, out, local_dir, job, mode], env=dict(os.environ, **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
    return proc.returncode, text[-3000:]


def _tiny():
    """A one-layer model in the Trainer's calling convention (a dict with the loss)."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x, labels=None):
            y = self.lin(x).squeeze(-1)
            return {"loss": ((y - labels) ** 2).mean(), "logits": y}

    return Tiny()


def _read(out: str, job: str, mode: str) -> tuple[dict, dict]:
    import torch

    with open(os.path.join(out, f"{job}-{mode}.json")) as f:
        log = json.load(f)
    return log, torch.load(os.path.join(out, f"{job}-{mode}.pt"))


@pytest.mark.timeout(180)
def test_trainer_sigkill_resumes_bitwise(local_dir, tmp_path):
    require("transformers", "transformers")
    out = str(tmp_path)
    kill_mid_save = FaultInjector().fail_at(phase="sidecar", step=6, action="kill").env()  # thread writer: this process
    ref = _start(out, local_dir, "ref", "full")  # resume=True on an empty job: from scratch
    crash = _start(out, local_dir, "crash", "crash", kill_mid_save)
    code, text = _finish(crash)
    assert code == -signal.SIGKILL, text
    code, text = _finish(ref)
    assert code == 0, text
    rank = os.path.join(local_dir, "crash", "rank-00000")
    assert os.path.exists(os.path.join(rank, "step-000000000004.json"))
    assert os.path.exists(os.path.join(rank, "step-000000000006.safetensors"))  # written, never committed
    assert not os.path.exists(os.path.join(rank, "step-000000000006.json"))

    resume = _start(out, local_dir, "crash", "resume")
    # The reference job ends at step 9 (end of epoch 2); another gradient accumulation
    # would make the Trainer skip to another sample: refused, naming the fix.
    mismatch = _start(out, local_dir, "ref", "mismatch")
    code, text = _finish(resume)
    assert code == 0, text
    code, text = _finish(mismatch)
    assert code != 0 and "ignore_data_skip=True" in text and "CheckpointError" in text, text

    (full, full_w), (resumed, resumed_w) = _read(out, "ref", "full"), _read(out, "crash", "resume")
    assert full["resumed"] is None and full["restore_step"] is None
    assert resumed["resumed"] == 4 and resumed["restore_step"] == 4
    logs = {e["step"]: e for e in full["log_history"] if "loss" in e}
    again = {e["step"]: e for e in resumed["log_history"] if "loss" in e}
    assert sorted(logs) == sorted(again) == list(range(1, 10))
    for step in range(1, 10):  # 1-4 come back from the saved TrainerState, 5-9 are trained again
        for key in ("loss", "grad_norm", "learning_rate", "epoch"):
            assert again[step][key] == logs[step][key], f"step {step} {key}: {again[step][key]!r} != {logs[step][key]!r}"
    import torch

    assert full_w.keys() == resumed_w.keys()
    for name, value in full_w.items():
        assert torch.equal(value, resumed_w[name]), f"{name} differs after the resumed run"


def test_the_trainer_takes_checkpointer_options_as_a_dict_like_lightning(local_dir, tmp_path):
    """``checkpointer=dict(...)`` (the Lightning strategies' form) makes a Checkpointer
    with those options, closed when train() returns; anything else is refused at once,
    not with an AttributeError at the first save."""
    require("transformers", "transformers")
    import torch
    from transformers import TrainingArguments

    from incluster.integrations.transformers import InclusterTrainer

    data = [{"x": torch.randn(2), "labels": torch.tensor(0.0)} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, save_steps=1, report_to=[], use_cpu=True)
    t = InclusterTrainer(model=_tiny(), args=args, train_dataset=data,
                         checkpointer=dict(local_dir=local_dir, job="as-dict", writer="thread"))
    t.train()
    assert t.incluster_handle.step == 2 and t._ic_checkpointer is None  # made from the dict, closed after train()
    assert os.path.isdir(os.path.join(local_dir, "as-dict"))
    with pytest.raises(TypeError, match="a dict of its options"):
        InclusterTrainer(model=_tiny(), args=args, train_dataset=data, checkpointer="as-dict")


def test_the_runs_last_step_goes_to_the_persistent_tier_whatever_its_schedule(local_dir, tmp_path):
    require("transformers", "transformers")
    import torch
    from transformers import TrainingArguments

    from incluster.integrations.transformers import InclusterTrainer

    data = [{"x": torch.randn(2), "labels": torch.tensor(0.0)} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, save_steps=3, report_to=[], use_cpu=True)
    tier = tmp_path / "tier"
    t = InclusterTrainer(model=_tiny(), args=args, train_dataset=data,
                         checkpointer=dict(local_dir=local_dir, job="tiered", writer="thread", persistent=str(tier),
                                           persistent_every=100))  # the tier's schedule: the first save only
    t.train()
    assert t.incluster_handle.step == 4 and t.incluster_handle.persisted.result(30) is True
    assert sorted(n for n in os.listdir(tier / "tiered") if n.startswith("step-")) == ["step-000000000003", "step-000000000004"]


def test_rerunning_a_finished_job_trains_nothing_and_leaves_no_resume_folder(local_dir, tmp_path, monkeypatch):
    """The Trainer checks max_steps only after a step: every rerun of a finished job
    trained (and saved) one step more. The folder that hands the restored TrainerState to
    the Trainer goes when train() ends, and one a SIGKILLed run left behind goes at the
    next train() on the node."""
    require("transformers", "transformers")
    import subprocess
    import sys
    import tempfile

    import torch
    from transformers import TrainingArguments

    from incluster.integrations.transformers import InclusterTrainer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"incluster-trainer-resume-{int(dead.stdout)}-abc"  # a killed run's
    orphan.mkdir()
    mine = tmp_path / f"incluster-trainer-resume-{os.getpid()}-xyz"  # a live process's: kept
    mine.mkdir()

    torch.manual_seed(0)
    data = [{"x": torch.randn(2), "labels": torch.tensor(1.0)} for _ in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=5, save_steps=5, report_to=[], use_cpu=True,
                             per_device_train_batch_size=2)
    model = _tiny()
    trainer = InclusterTrainer(model=model, args=args, train_dataset=data,
                               checkpointer=dict(local_dir=local_dir, job="finished", writer="thread"))
    trainer.train(resume_from_checkpoint=True)  # nothing saved yet: from scratch
    assert trainer.state.global_step == 5 and trainer.incluster_handle.step == 5
    assert not orphan.exists() and mine.exists()
    done = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        again = _tiny()
        trainer = InclusterTrainer(model=again, args=args, train_dataset=data,
                                   checkpointer=dict(local_dir=local_dir, job="finished", writer="thread"))
        trainer.train(resume_from_checkpoint=True)
        assert trainer.incluster_resumed_step == 5 and trainer.state.global_step == 5
        assert all(torch.equal(v, done[k]) for k, v in again.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("incluster-trainer")) == [mine.name]


def test_a_run_that_would_save_behind_its_job_is_refused_before_it_trains(local_dir, tmp_path):
    """train() without resume_from_checkpoint=True on a job that holds step 6 used to
    train until its first save, then fail there (steps must increase), the training lost.
    It is now refused before the first step, naming the fix, whether that save is a step
    count, a ratio of max_steps or an epoch's end; a run whose first save is above the
    held step, or that never saves, trains."""
    require("transformers", "transformers")
    import torch
    from transformers import TrainingArguments

    from incluster.errors import CheckpointError
    from incluster.integrations.transformers import InclusterTrainer

    data = [{"x": torch.randn(2), "labels": torch.tensor(1.0)} for _ in range(8)]  # 4 steps an epoch

    def trainer(steps: int, **kw: object) -> InclusterTrainer:
        kw.setdefault("save_steps", 3)
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, report_to=[], use_cpu=True,
                                 per_device_train_batch_size=2, **kw)  # type: ignore[arg-type]
        return InclusterTrainer(model=_tiny(), args=args, train_dataset=data,
                                checkpointer=dict(local_dir=local_dir, job="held", writer="thread"))

    trainer(6).train()  # saves steps 3 and 6
    for steps, kw in [(9, {}), (20, {"save_steps": 0.25}), (9, {"save_strategy": "epoch"})]:
        t = trainer(steps, **kw)
        before = {k: v.clone() for k, v in t.model.state_dict().items()}
        with pytest.raises(CheckpointError, match=r"already holds step 6, and train\(\) starts at step 0") as e:
            t.train()
        assert "resume_from_checkpoint=True" in str(e.value) and t.state.global_step == 0
        assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())  # nothing trained
    unsaved = trainer(2, save_strategy="no")
    unsaved.train()
    assert unsaved.state.global_step == 2 and unsaved.incluster_handle is None
    later = trainer(8, save_steps=7)  # its first save, step 7, is above step 6
    later.train()
    assert later.incluster_handle.step == 8


def test_a_job_with_no_incluster_step_resumes_from_the_trainers_own_checkpoint(local_dir, tmp_path, caplog):
    """A run moved from the Trainer's own checkpoints onto incluster with
    resume_from_checkpoint=True started from scratch without a word, its progress in
    output_dir/checkpoint-N ignored. It now goes on from the newest of them, as the Trainer
    would: the steps after it match a run that never stopped."""
    require("transformers", "transformers")
    import torch
    from transformers import Trainer, TrainingArguments

    from incluster.integrations.transformers import InclusterTrainer

    g = torch.Generator().manual_seed(3)
    data = [{"x": torch.randn(2, generator=g), "labels": torch.randn((), generator=g)} for _ in range(24)]

    def args(out: str, steps: int) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path / out), max_steps=steps, save_steps=3, logging_steps=1,
                                 per_device_train_batch_size=4, lr_scheduler_type="constant", report_to=[],
                                 use_cpu=True, seed=0)

    def model(seed: int):
        torch.manual_seed(seed)
        return _tiny()

    Trainer(model=model(0), args=args("moved", 6), train_dataset=data).train()  # checkpoint-3 and -6
    torch.save(None, tmp_path / "moved" / "checkpoint-6" / "partial")  # newest, but no state: not a checkpoint
    os.remove(tmp_path / "moved" / "checkpoint-6" / "trainer_state.json")
    ref = InclusterTrainer(model=model(0), args=args("ref", 9), train_dataset=data,
                           checkpointer=dict(local_dir=local_dir, job="ref", writer="thread"))
    ref.train()
    moved = InclusterTrainer(model=model(7), args=args("moved", 9), train_dataset=data,
                             checkpointer=dict(local_dir=local_dir, job="moved", writer="thread"))
    with caplog.at_level("WARNING", logger="incluster"):
        moved.train(resume_from_checkpoint=True)
    said = [r.getMessage() for r in caplog.records if "checkpoint-3" in r.getMessage()]
    assert said and "holds no step yet; resuming from the Trainer's own checkpoint" in said[0], caplog.text
    assert moved.incluster_resumed_step is None and moved.incluster_handle.step == 9
    losses = {e["step"]: e["loss"] for e in ref.state.log_history if "loss" in e}
    again = {e["step"]: e["loss"] for e in moved.state.log_history if "loss" in e}
    assert [again[s] for s in range(4, 10)] == [losses[s] for s in range(4, 10)]
    for (name, value), mine in zip(ref.model.state_dict().items(), moved.model.state_dict().values()):
        assert torch.equal(value, mine), name


_FIND = """
import os, sys
import torch.distributed as dist
from incluster.errors import CheckpointError
from incluster.integrations.hf_state import trainer_checkpoint
dist.init_process_group("gloo")
out = os.path.join(sys.argv[1], f"rank{dist.get_rank()}" if sys.argv[2] == "apart" else "shared")
try:
    print("found", os.path.basename(trainer_checkpoint(out) or "none"))
except CheckpointError as exc:
    print("refused", exc)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_ranks_that_find_different_trainer_checkpoints_are_refused(tmp_path):
    """Each rank reads its own output_dir: a rank resuming from another step than its
    peers would train on from a mixed state."""
    from incluster.testing.launch import launch

    script = tmp_path / "find.py"
    script.write_text(_FIND)
    for folder, steps in (("rank0", (3,)), ("rank1", (3, 6)), ("shared", (3, 6))):
        for step in steps:
            os.makedirs(tmp_path / folder / f"checkpoint-{step}")
            (tmp_path / folder / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    for how, said in (("apart", "refused the job holds no incluster step, and the ranks find different Trainer "
                                "checkpoints in output_dir '"), ("shared", "found checkpoint-6")):
        job = launch([str(script), str(tmp_path), how], nodes=["n0"], ranks_per_node=2, base_dir=str(tmp_path / how))
        assert job.wait(60) == [0, 0], [job.output(r) for r in range(2)]
        for rank in range(2):
            assert said in job.output(rank), job.output(rank)
            assert how == "shared" or "(rank by rank: ['checkpoint-3', 'checkpoint-6'])" in job.output(rank)
