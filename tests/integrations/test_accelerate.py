"""Accelerate through incluster (tests/integrations/hf_accelerate_run.py, one CPU process
or two DDP ranks per run): a loop with dropout, a shuffled DataLoader without a seeded sampler (order from the
global RNG, or from the loader's own generator), AdamW with a
warmup schedule and a registered counter saves at mid-epoch and end-of-epoch steps; runs
wait until one save is durable and are SIGKILLed while a later save is half written; fresh
processes resume with ``AcceleratorCheckpoint.load()`` + ``batches()`` and must match an
uninterrupted run bit for bit (every loss after the restored step, the counter, the final
weights), in one process and on two DDP ranks (gloo). Plus the plain ``state_for`` dict
through ``ckpt.save``/``ckpt.load``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import incluster
from incluster.errors import CheckpointError
from incluster.testing.faults import FaultInjector
from incluster.testing.launch import free_port
from integrations.conftest import require

SCRIPT = os.path.join(os.path.dirname(__file__), "hf_accelerate_run.py")
# (job, its reference job, processes, step whose save is awaited, step whose save is killed
# half written). One process: 5 batches per epoch, 15 steps; step 6 is mid-epoch, 10 ends
# one. "-gen": the loader shuffles with its own generator. Two DDP ranks (gloo): 3 batches
# per epoch and rank, 9 steps; step 5 is mid-epoch, the sampler's generator is accelerate's
# synchronized one (restored to its state at the epoch's start, as a "-gen" loader's is).
CASES = [("mid-global", "ref-global", 1, 6, 9), ("end-gen", "ref-gen", 1, 10, 12), ("ddp", "ref-ddp", 2, 5, 6)]
REFS = {ref: n for _, ref, n, _, _ in CASES}


def _start(out: str, local_dir: str, job: str, mode: str, ranks: int, *extra: str,
           env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """One process, or every rank of a DDP job the way a launcher starts them."""
    port, procs = free_port(), []
    for rank in range(ranks):
        dist = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if ranks > 1 else {}
        procs.append(subprocess.Popen([sys.executable, SCRIPT, out, local_dir, job, mode, *extra],
                                      env=dict(os.environ, **dist, **(env or {})), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[tuple[int | None, str]]:
    """(exit code, output tail) of each process; None for one killed here at the deadline,
    which must not pass for the injected SIGKILL. Every output of the job goes with each."""
    deadline, codes, texts = time.monotonic() + timeout, [], []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(proc.returncode)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            codes.append(None)
        texts.append(text[-3000:])
    job = "\n".join(f"--- process {i} (exit {c}):\n{t}" for i, (c, t) in enumerate(zip(codes, texts)))
    return [(code, job) for code in codes]


def _kill_when_hung(jobs: list[list[subprocess.Popen[str]]], marks: list[tuple[str, int, int]],
                    timeout: float = 120) -> None:
    """SIGKILL every process of each job once all its ranks hang with ``step``'s shard
    renamed and its commit record unwritten, as a launcher kills a whole job whose node
    died. Killing at the fault itself would race on several ranks: the first rank killed
    takes the job store (rank 0's) along, and a slower rank's commit then fails on the
    lost store before it gets there. A job one of whose processes ended first is killed
    as it stands; the caller's checks name what went wrong."""
    deadline, left = time.monotonic() + timeout, list(range(len(jobs)))
    while left:
        for i in list(left):
            folder, ranks, step = marks[i]
            hung = all(os.path.exists(os.path.join(folder, f"fault-sidecar-r{r}-s{step}")) for r in range(ranks))
            if hung or any(p.poll() is not None for p in jobs[i]) or time.monotonic() > deadline:
                for p in jobs[i]:
                    if p.poll() is None:
                        p.kill()
                left.remove(i)
        time.sleep(0.05)


def _read(out: str, job: str, mode: str, rank: int | None) -> tuple[dict, dict]:
    name = f"{job}-{mode}" + ("" if rank is None else f"-rank{rank}")
    with open(os.path.join(out, f"{name}.json")) as f:
        log = json.load(f)
    return log, torch.load(os.path.join(out, f"{name}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_accelerate_sigkill_resumes_bitwise(local_dir, tmp_path):
    require("accelerate", "accelerate")
    out = str(tmp_path)
    refs = [_start(out, local_dir, ref, "full", n) for ref, n in REFS.items()]
    marks = {job: str(tmp_path / f"hung-{job}") for job, *_ in CASES}
    for folder in marks.values():
        os.makedirs(folder)
    crashes = [_start(out, local_dir, job, "crash", n, str(wait),
                      env=FaultInjector().fail_at(phase="sidecar", step=kill, action="hang",
                                                  marker_dir=marks[job]).env())
               for job, _, n, wait, kill in CASES]
    _kill_when_hung(crashes, [(marks[job], n, kill) for job, _, n, _, kill in CASES])
    for code, text in [r for procs in refs for r in _finish(procs)]:
        assert code == 0, text
    for (job, _, n, _, kill), procs in zip(CASES, crashes):
        for code, text in _finish(procs):
            assert code == -signal.SIGKILL, text
        for rank in range(n):  # every rank held its save half written when the job was killed
            assert os.path.exists(os.path.join(marks[job], f"fault-sidecar-r{rank}-s{kill}")), text
    for job, _, n, wait, kill in CASES:
        for rank in range(n):
            folder = os.path.join(local_dir, job, f"rank-{rank:05d}")
            assert os.path.exists(os.path.join(folder, f"step-{wait:012d}.json"))
            assert os.path.exists(os.path.join(folder, f"step-{kill:012d}.safetensors"))  # written, not committed
            assert not os.path.exists(os.path.join(folder, f"step-{kill:012d}.json"))

    resumes = [_start(out, local_dir, job, "resume", n) for job, _, n, _, _ in CASES]
    for code, text in [r for procs in resumes for r in _finish(procs)]:
        assert code == 0, text
    for job, ref, n, wait, kill in CASES:
        for rank in range(n) if n > 1 else [None]:
            full, full_w = _read(out, ref, "full", rank)
            resumed, resumed_w = _read(out, job, "resume", rank)
            where = f"{job} rank {rank or 0}"
            assert resumed["resumed"] == wait, f"{where}: restored {resumed['resumed']}, not the newest complete step"
            last = max(map(int, full["losses"]))
            assert sorted(map(int, resumed["losses"])) == list(range(wait + 1, last + 1)), f"{where}: wrong batch"
            for step, loss in resumed["losses"].items():
                assert loss == full["losses"][step], f"{where} step {step}: {loss!r} != {full['losses'][step]!r}"
            assert (resumed["seen"], resumed["total"]) == (full["seen"], full["total"]), "registered object"
            for name, value in full_w.items():
                assert torch.equal(value, resumed_w[name]), f"{where}: {name} differs after the resumed run"


def test_state_for_round_trip(local_dir):
    require("accelerate", "accelerate")
    from accelerate import Accelerator

    from incluster.integrations.accelerate import state_for

    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["n"]

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    for _ in range(2):
        acc.backward(model(torch.randn(3, 4)).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
    counter.n, acc.step = 5, 3
    with pytest.raises(CheckpointError, match="clash"):
        state_for(acc, rng=1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    random.seed(11)
    torch.manual_seed(21)
    expect = (random.random(), torch.rand(3))
    random.seed(11)
    torch.manual_seed(21)
    with incluster.Checkpointer(local_dir=local_dir, job="sf", writer="thread") as ckpt:
        ckpt.save(2, state_for(acc, extra={"tokens": 96})).wait()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        acc.backward(model(torch.randn(3, 4)).sum())
        opt.step()
        sched.step()
        counter.n, acc.step = 0, 0
        random.seed(12)
        torch.manual_seed(22)
        extra: dict[str, int] = {}
        assert ckpt.load(state_for(acc, extra=extra)) == 2
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt)
    assert sched.get_last_lr() == [0.025] and counter.n == 5 and acc.step == 3 and extra == {"tokens": 96}
    assert random.random() == expect[0] and torch.equal(torch.rand(3), expect[1]), "RNG states not restored"


def test_saves_that_a_resume_cannot_reproduce_are_named(local_dir, caplog):
    """A save mid gradient accumulation (its gradients are not saved) and a loop that never
    iterates batches() (no data position): each is said once, with the fix."""
    require("accelerate", "accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from incluster.integrations.accelerate import AcceleratorCheckpoint

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    ac = AcceleratorCheckpoint(acc, incluster.Checkpointer(local_dir=local_dir, job="ga", writer="thread"))
    with caplog.at_level("WARNING", logger="incluster"):
        for i, (x,) in enumerate(loader):  # the loader itself, not ac.batches(): no position
            with acc.accumulate(model):
                acc.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
            ac.save(i + 1)  # batch 1 ends mid accumulation; batch 2 on an optimizer step
        ac.close()
    said = [r.getMessage() for r in caplog.records]
    assert sum("middle of gradient accumulation" in m for m in said) == 1, said
    assert sum("saved without a data position" in m and "batches()" in m for m in said) == 1, said
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_a_resume_with_another_number_of_processes_is_refused_by_name():
    from incluster.integrations.rng import refuse_resize
    from incluster.recovery.restore import RestoreReport

    ck = type("Ck", (), {"world_size": 1, "last_restore": RestoreReport(0, "n0", 8, source="reshard", old_world=2)})()
    with pytest.raises(CheckpointError, match=r"step 8 was saved by 2 process\(es\) and this run has 1: why.*Resume with 2"):
        refuse_resize(ck, "why")
    ck.last_restore = RestoreReport(0, "n0", 8, source="local")
    refuse_resize(ck, "why")  # the same world: nothing to say


def test_a_resume_with_another_batch_size_is_refused_instead_of_skipping_other_samples(local_dir):
    """Saved after 3 batches of 8; resumed with batches of 16, skipping 3 batches would
    skip 48 samples where the run had taken 24: samples never trained on, without a word."""
    require("accelerate", "accelerate")
    import torch
    from accelerate import Accelerator

    import incluster
    from incluster.integrations.accelerate import AcceleratorCheckpoint

    data = torch.utils.data.TensorDataset(torch.arange(64.0).unsqueeze(1))

    def setup(batch_size):
        acc = Accelerator(cpu=True)
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        ck = incluster.Checkpointer(local_dir=local_dir, job="bs", writer="thread")
        return model, opt, loader, AcceleratorCheckpoint(acc, ck)

    model, opt, loader, ac = setup(8)
    for i, (x,) in enumerate(ac.batches(loader, 0), start=1):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            ac.save(3).wait()
            break
    ac.close()
    model, opt, loader, ac = setup(16)
    try:
        assert ac.load() == 3
        with pytest.raises(incluster.CheckpointError, match="3 batches of 8 samples.*batches of 8"):
            next(iter(ac.batches(loader, ac.epoch)))
    finally:
        ac.close()


def test_processes_accelerate_does_not_synchronize_are_warned_about(caplog):
    """Under torchrun on a machine without GPUs, Accelerator() (no cpu=True) runs each
    process alone: two unsynchronized trainings that incluster saved as one job's ranks."""
    from types import SimpleNamespace

    from incluster.integrations.accelerate import _warn_unsynchronized

    alone = SimpleNamespace(num_processes=1, distributed_type=SimpleNamespace(name="NO"))
    with caplog.at_level("WARNING", logger="incluster"):
        _warn_unsynchronized(alone, SimpleNamespace(world_size=2))
        _warn_unsynchronized(SimpleNamespace(num_processes=2), SimpleNamespace(world_size=2))  # DDP: nothing to say
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "the launch has 2 processes, but accelerate runs 1" in said[0], said
    assert "Accelerator(cpu=True)" in said[0]


def test_a_run_over_a_job_with_steps_that_did_not_call_load_is_refused_before_it_trains(local_dir):
    """The Checkpointer refused only the first save, a save interval later, and named its
    own load(), not the AcceleratorCheckpoint's."""
    require("accelerate", "accelerate")
    from accelerate import Accelerator

    from incluster.integrations.accelerate import AcceleratorCheckpoint

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(4, 2))
    loader = acc.prepare(torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
    with incluster.Checkpointer(local_dir=local_dir, job="nl", writer="thread") as ckpt:
        ac = AcceleratorCheckpoint(acc, ckpt)
        assert ac.load() is None
        for _ in ac.batches(loader, 0):
            pass
        ac.save(3).wait()
    with incluster.Checkpointer(local_dir=local_dir, job="nl", writer="thread") as ckpt:
        ac = AcceleratorCheckpoint(acc, ckpt)
        with pytest.raises(CheckpointError, match=r"did not call AcceleratorCheckpoint.load\(\): call `start = ac.load"):
            next(iter(ac.batches(loader, 0)))
        with pytest.raises(CheckpointError, match="already holds step 3"):
            ac.save(1)
        assert ac.load() == 3
        assert sum(1 for _ in ac.batches(loader, 1)) == 4  # resumed: the loop goes on
    del model
