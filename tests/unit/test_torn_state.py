"""No torn state, whatever shape the state comes in: the optimizer steps right after
``save()`` returns, while staging is deliberately slow, and the saved bytes must be the
values at ``save()`` time."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import incluster
from incluster.staging.engine import Stager
from incluster.state import flatten
from incluster.tiers.local import ShardReader

from helpers import tiny_model, train


@pytest.fixture
def slow_staging(monkeypatch):
    """Staging starts 0.3 s late: an optimizer step that does not wait lands in the copy."""
    run = Stager.run

    def late(self, job):
        time.sleep(0.3)
        return run(self, job)

    monkeypatch.setattr(Stager, "run", late)


def _model_and_optim():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, o


def _grads(m):
    m(torch.randn(16, 64)).pow(2).mean().backward()


def _assert_shard_is(folder, step, expected):
    flat = flatten(expected)
    with ShardReader(folder, step) as r:
        differ = [s.name for s, t in zip(flat.specs, flat.tensors) if not torch.equal(r.tensor(s.name), t)]
    assert not differ, f"{len(differ)} of {len(flat.specs)} tensors hold values from after save(): {differ[:4]}"


def _ckpt(local_dir):
    return incluster.Checkpointer(local_dir=local_dir, job="torn", writer="thread")


def test_plain_dicts_from_get_state_dict_are_not_torn(local_dir, slow_staging):
    m, o = _model_and_optim()
    with _ckpt(local_dir) as ck:
        _grads(m)
        o.step()  # seen stepping: its parameters and state are not copied at save() time
        o.zero_grad()
        msd, osd = get_state_dict(m, o)
        expected = copy.deepcopy({"model": msd, "optim": osd})
        _grads(m)  # the next step's gradients are ready
        h = ck.save(1, {"model": msd, "optim": osd})
        o.step()  # right after save() returns: must wait for staging
        h.wait()
        _assert_shard_is(ck.folder, 1, expected)


class AppState:
    """The torchtitan / DCP-tutorial pattern: a Stateful wrapper over get_state_dict."""

    def __init__(self, m, o):
        self.m, self.o = m, o

    def state_dict(self):
        msd, osd = get_state_dict(self.m, self.o)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd):  # pragma: no cover - not loaded here
        raise NotImplementedError


def test_stateful_app_state_is_not_torn(local_dir, slow_staging):
    m, o = _model_and_optim()
    with _ckpt(local_dir) as ck:
        _grads(m)
        o.step()
        o.zero_grad()
        app = AppState(m, o)
        expected = copy.deepcopy(app.state_dict())
        _grads(m)
        h = ck.save(1, {"app": app})
        o.step()
        h.wait()
        _assert_shard_is(ck.folder, 1, {"app": expected})


def test_buffers_in_a_plain_state_dict_keep_their_save_time_values(local_dir, slow_staging):
    m = tiny_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    train(m, o, 1)
    with _ckpt(local_dir) as ck:
        sd = m.state_dict()
        expected = {"model": {k: v.clone() for k, v in sd.items()}}
        h = ck.save(1, {"model": sd})
        m(torch.randn(8, 16) * 100)  # forward right after save(): BatchNorm statistics change
        h.wait()
        _assert_shard_is(ck.folder, 1, expected)


def test_tensors_of_an_optimizer_not_yet_seen_are_copied_at_save_time(local_dir, slow_staging):
    """An optimizer that stepped before the Checkpointer existed: its parameters are not
    known to be guarded yet, so they are cloned at save() (the hook guards them anyway)."""
    m, o = _model_and_optim()
    _grads(m)
    o.step()
    o.zero_grad()
    with _ckpt(local_dir) as ck:
        msd, osd = get_state_dict(m, o)
        expected = copy.deepcopy({"model": msd, "optim": osd})
        h = ck.save(1, {"model": msd, "optim": osd})
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)  # not an optimizer step: no hook waits
        h.wait()
        _assert_shard_is(ck.folder, 1, expected)


def test_large_unguarded_tensors_are_named_once(local_dir, monkeypatch, caplog):
    monkeypatch.setattr(incluster.guard, "CLONE_LIMIT", 1024)
    big = {"w": torch.zeros(4096)}
    with _ckpt(local_dir) as ck, caplog.at_level(logging.WARNING, logger="incluster"):
        ck.save(1, big).wait()
        ck.save(2, big).wait()
    said = [r for r in caplog.records if "wait_staged" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_the_step_hook_is_global_and_goes_at_close(local_dir):
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    before = len(_global_optimizer_pre_hooks)
    ck = _ckpt(local_dir)
    assert len(_global_optimizer_pre_hooks) == before + 1
    ck.close()
    assert len(_global_optimizer_pre_hooks) == before


def test_time_the_optimizer_waits_for_staging_is_counted_as_save_cost(local_dir, slow_staging, tmp_path):
    import json

    from incluster.goodput.reader import read_run
    from incluster.goodput.report import account_rank

    m, o = _model_and_optim()
    run = tmp_path / "run"
    with incluster.Checkpointer(local_dir=local_dir, job="torn", writer="thread", run_dir=run) as ck:
        _grads(m)
        o.step()
        _grads(m)  # before save(): a slow backward on a loaded machine must not eat the wait
        h = ck.save(1, {"model": m, "optim": o})
        o.step()  # waits ~0.3 s for the late staging
        h.wait()
    events = [json.loads(x) for f in run.iterdir() for x in f.read_text().splitlines()]
    waits = [e for e in events if e["kind"] == "stage_wait"]
    assert len(waits) == 1 and waits[0]["step"] == 1 and waits[0]["seconds"] > 0.2, waits
    attempts = next(iter(read_run(run).values()))
    t = [float(e["t"]) for e in events]
    acc = account_rank(attempts, min(t), max(t))
    assert acc["checkpoint_save"] >= waits[0]["seconds"]


class _Aliased(torch.nn.Module):
    """A persistent statistic and a non-persistent view of the same memory (same data
    pointer, another shape), registered after it: forward updates the statistic in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.arange(8.0))
        self.register_buffer("grid", self.stat.view(2, 4), persistent=False)

    def forward(self) -> None:
        self.stat.mul_(10)


def test_a_buffer_keeps_its_save_time_value_when_a_view_of_it_shares_its_pointer(local_dir, slow_staging):
    m = _Aliased()
    with _ckpt(local_dir) as ck:
        expected = {"model": {"stat": m.stat.clone()}}
        h = ck.save(1, {"model": m})
        m()  # forward right after save(): the statistic changes
        h.wait()
        _assert_shard_is(ck.folder, 1, expected)


def test_two_views_of_one_tensor_in_a_plain_dict_both_keep_their_save_time_values(local_dir, slow_staging):
    w = torch.arange(12.0)
    with _ckpt(local_dir) as ck:
        state = {"flat": w, "grid": w.view(3, 4)}  # no optimizer guards either: both cloned at save()
        expected = {k: v.clone() for k, v in state.items()}
        h = ck.save(1, state)
        w.mul_(10)
        h.wait()
        _assert_shard_is(ck.folder, 1, expected)


@pytest.mark.parametrize("change", ["load_state_dict", "param.data", "state_moved"])
def test_a_tensor_an_optimizer_let_go_of_is_copied_at_save_time(local_dir, slow_staging, change):
    """The pointers only a step changes were cached per optimizer, keyed by the counts of
    its state and parameters: after ``opt.load_state_dict`` (new state tensors) or a
    parameter's ``.data`` replaced, the counts stay, so memory the optimizer no longer
    owned - freed and reused for a plain tensor, here kept as one - was still taken as
    guarded: not copied at save(), and its next in-place change landed in the checkpoint."""
    m, o = _model_and_optim()
    _grads(m)
    o.step()
    with _ckpt(local_dir) as ck:
        ck.save(1, {"model": m, "optim": o, "extra": {"ema": torch.zeros(4)}}).wait()  # guarded pointers cached
        first = next(iter(m.parameters()))
        if change == "load_state_dict":
            let_go = o.state[first]["exp_avg"]
            o.load_state_dict(copy.deepcopy(o.state_dict()))
        elif change == "param.data":
            let_go = first.data
            first.data = first.data.clone()
        else:  # an offload and back, in place: the same dicts, new tensors
            let_go = o.state[first]["exp_avg"]
            for st in o.state.values():
                for k, v in list(st.items()):
                    st[k] = v.clone()
        state = {"model": m, "optim": o, "extra": {"ema": let_go}}
        expected = {"extra": {"ema": let_go.clone()}}
        h = ck.save(2, state)
        let_go.add_(1.0)  # a plain tensor now: changed at once, no optimizer step
        h.wait()
        _assert_shard_is(ck.folder, 2, expected | {"model": m.state_dict()})
