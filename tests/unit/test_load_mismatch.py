"""A live state unlike the saved one is refused, never silently converted, and a refusal
after bytes landed says the live state was partly overwritten."""

from __future__ import annotations

import pytest
import torch

import incluster
from incluster.errors import CheckpointError


def _save(local_dir, state, step=1):
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        ck.save(step, state).wait()


def _load(local_dir, state):
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        return ck.load(state)


def test_an_int64_checkpoint_is_not_wrapped_into_an_int32_tensor(local_dir):
    _save(local_dir, {"counts": torch.tensor([2**40 + 7, -(2**35), 3])})
    live = {"counts": torch.zeros(3, dtype=torch.int32)}
    with pytest.raises(CheckpointError, match=r"counts: the checkpoint holds torch.int64 values but the live tensor is torch.int32"):
        _load(local_dir, live)
    assert live["counts"].tolist() == [0, 0, 0]


def test_fp32_weights_are_not_rounded_into_a_bf16_model(local_dir):
    torch.manual_seed(0)
    _save(local_dir, {"model": torch.nn.Linear(64, 64)})
    live = torch.nn.Linear(64, 64).to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"float32 values but the live tensor is torch.bfloat16.*cast it after load"):
        _load(local_dir, {"model": live})


def test_a_shape_mismatch_is_refused_before_any_tensor_is_overwritten(local_dir):
    """The first tensors fit, the last does not: none of them may have changed."""
    torch.manual_seed(0)
    _save(local_dir, {"model": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))})
    torch.manual_seed(1)
    live = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))  # another head
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model/1.weight: the checkpoint holds shape \(8, 64\)") as err:
        _load(local_dir, {"model": live})
    assert "partly overwritten" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())


def test_a_pickled_value_without_allow_pickle_is_refused_before_any_tensor_is_overwritten(local_dir):
    import fractions

    torch.manual_seed(0)
    with incluster.Checkpointer(local_dir=local_dir, job="pk", replicas=0, allow_pickle=True) as ck:
        ck.save(1, {"model": torch.nn.Linear(8, 8), "extra": {"frac": fractions.Fraction(1, 3)}}).wait(30)
    torch.manual_seed(1)
    live = torch.nn.Linear(8, 8)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with incluster.Checkpointer(local_dir=local_dir, job="pk", replicas=0) as ck:
        with pytest.raises(CheckpointError, match="extra/frac: this checkpoint holds a pickled object") as err:
            ck.load({"model": live, "extra": {"frac": None}})
    assert "partly overwritten" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())


def test_a_refused_load_leaves_a_fresh_optimizer_without_state(local_dir):
    """The usual restart builds the model and optimizer, then loads. Into a model of
    another size the load is refused, but the fresh optimizer was left at step 1 with
    zero moments: a caller that then trains afresh had other bias corrections."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    _save(local_dir, {"model": model, "optim": optim})
    live = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 4))
    fresh = torch.optim.AdamW(live.parameters())
    with pytest.raises(CheckpointError, match="the checkpoint holds shape"):
        _load(local_dir, {"model": live, "optim": fresh})
    assert fresh.state_dict()["state"] == {}


@pytest.mark.parametrize("saved, live, says", [
    (lambda: torch.nn.Linear(4, 8).state_dict(), lambda: torch.nn.Linear(4, 4), r"x/weight: the checkpoint holds shape \(8, 4\)"),
    (lambda: torch.nn.Linear(4, 4).state_dict(), lambda: torch.nn.Linear(4, 4).bfloat16(), "float32 values but the live tensor is torch.bfloat16"),
    (lambda: {"weight": torch.ones(4, 4)}, lambda: torch.nn.Linear(4, 4), r"x: the live module has keys the checkpoint lacks: \['bias'\]"),
    (lambda: torch.ones(3), lambda: torch.nn.Linear(1, 1), "holds a tensor here, which the live torch.nn"),
    (lambda: 5, lambda: torch.nn.Linear(1, 1), "holds a value here"),
    (lambda: {"a": 1}, lambda: torch.zeros(3), "holds a dict here, but the live state has a tensor"),
    (lambda: [1, 2], lambda: torch.zeros(2), "holds a list here"),
    (lambda: {"m": torch.ones(3)}, lambda: {"m": torch.nn.Linear(1, 1)}, "x/m: the checkpoint holds a tensor"),
])
def test_a_value_the_live_object_cannot_take_is_refused_not_ignored(local_dir, saved, live, says):
    """load() returned the step while the live object kept what it had (the value was
    dropped): a tensor saved where the state now has a module, a dict where it has a tensor."""
    _save(local_dir, {"x": saved()})
    obj = live()
    with pytest.raises(CheckpointError, match=says):
        _load(local_dir, {"x": obj})


def test_a_saved_none_leaves_the_live_object_as_it_is(local_dir):
    """An fp32 run saved no grad scaler (None); its fp16 resume has one: it stays fresh."""
    _save(local_dir, {"scaler": None, "w": torch.ones(3)})
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    live = {"scaler": scaler, "w": torch.zeros(3)}
    assert _load(local_dir, live) == 1
    assert scaler.get_scale() == 1024.0 and torch.equal(live["w"], torch.ones(3))


def test_a_plain_tensor_is_not_dropped_into_a_dtensor(local_dir):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    _save(local_dir, {"w": torch.ones(4)})
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        live = distribute_tensor(torch.zeros(4), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(CheckpointError, match="holds a tensor here, but the live state has a DTensor"):
            _load(local_dir, {"w": live})  # it returned 1 with the shard still zeros
    finally:
        if mine:
            dist.destroy_process_group()


def test_a_model_saved_as_its_state_dict_loads_into_the_model(local_dir):
    """It returned the step and left the model's random weights (the README loads the
    model itself): the model takes the saved dict through load_state_dict()."""
    torch.manual_seed(0)
    saved = torch.nn.Linear(8, 8)
    _save(local_dir, {"model": saved.state_dict()})
    live = torch.nn.Linear(8, 8)
    assert _load(local_dir, {"model": live}) == 1
    assert torch.equal(live.weight, saved.weight) and torch.equal(live.bias, saved.bias)


def test_a_model_saved_as_its_state_dict_loads_into_its_state_dict(local_dir):
    torch.manual_seed(0)
    saved = torch.nn.Linear(8, 8)
    _save(local_dir, {"model": saved.state_dict()})
    live = torch.nn.Linear(8, 8)
    assert _load(local_dir, {"model": live.state_dict()}) == 1
    assert torch.equal(live.weight, saved.weight) and torch.equal(live.bias, saved.bias)


def test_a_module_with_other_keys_is_refused_before_any_tensor_is_overwritten(local_dir):
    """The matching tensors landed first and load_state_dict refused after them."""
    torch.manual_seed(0)
    _save(local_dir, {"model": torch.nn.Sequential(torch.nn.Linear(64, 64))})
    torch.manual_seed(1)
    live = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))  # one layer more
    before = live[0].weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"model: the live module has keys the checkpoint lacks: "
                                              r"\['1.bias', '1.weight'\]; build the model") as err:
        _load(local_dir, {"model": live})
    assert torch.equal(live[0].weight, before) and "partly overwritten" not in str(err.value)


def test_a_batchnorm_state_without_its_batch_count_still_loads(local_dir):
    """torch's BatchNorm takes a state without num_batches_tracked (an older or cleaned
    copy); the early check of a module's keys must not refuse what it would take."""
    bn = torch.nn.BatchNorm1d(4)
    bn(torch.randn(8, 4))
    saved = {k: v for k, v in bn.state_dict().items() if k != "num_batches_tracked"}
    _save(local_dir, {"m": saved})
    live = torch.nn.BatchNorm1d(4)
    assert _load(local_dir, {"m": live}) == 1
    assert torch.equal(live.running_mean, bn.running_mean)


def test_a_module_with_other_keys_beside_a_submodule_that_loads_its_own_way_is_still_refused_first(local_dir):
    """An InstanceNorm (its own loader) or a submodule with a load hook turned the early
    check off for the whole model; the keys outside that submodule are still judged. A
    plain buffer named num_batches_tracked is no BatchNorm's: missing, it is refused."""
    torch.manual_seed(0)
    _save(local_dir, {"model": torch.nn.Sequential(torch.nn.Conv2d(2, 2, 1), torch.nn.InstanceNorm2d(2))})
    live = torch.nn.Sequential(torch.nn.Conv2d(2, 2, 1), torch.nn.InstanceNorm2d(2), torch.nn.Conv2d(2, 2, 1))
    live[1].register_load_state_dict_pre_hook(lambda *args, **kw: None)
    before = live[0].weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"model: the live module has keys the checkpoint lacks: "
                                              r"\['2.bias', '2.weight'\]"):
        _load(local_dir, {"model": live})
    assert torch.equal(live[0].weight, before)

    _save(local_dir, {"model": torch.nn.Sequential(torch.nn.Linear(2, 2))}, step=2)
    counted = torch.nn.Linear(2, 2)
    counted.register_buffer("num_batches_tracked", torch.tensor(0))  # a plain module's, not a BatchNorm's
    with pytest.raises(CheckpointError, match=r"lacks: \['0.num_batches_tracked'\]"):
        _load(local_dir, {"model": torch.nn.Sequential(counted)})


def test_an_optimizer_with_other_parameter_groups_is_refused_before_any_tensor_is_overwritten(local_dir):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    _save(local_dir, {"model": m, "optim": opt})
    live = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = live[0].weight.detach().clone()
    groups = torch.optim.AdamW([{"params": live[0].parameters()}, {"params": live[1].parameters(), "lr": 0.1}])
    with pytest.raises(CheckpointError, match=r"optim: the checkpoint's optimizer has parameter groups of \[4\] "
                                              r"parameters, the live one \[2, 2\]"):
        _load(local_dir, {"model": live, "optim": groups})
    assert torch.equal(live[0].weight, before)


def test_a_failed_read_of_the_persistent_copy_is_the_tiers_failure_not_a_bad_copy(local_dir, tmp_path, monkeypatch):
    """Only the persistent tier holds step 2, and reading its shard fails (a connection
    reset, after the tier's own retries): load() raises TierUnavailableError, never sets
    the copy aside as bad (which ends in "every copy failed verification ... delete the
    persistent tier's folder") and never returns None (a fresh start over a good step)."""
    import shutil

    from incluster.tiers import persistent as P

    tier, ram = str(tmp_path / "tier"), f"{local_dir}/ram"
    want = torch.arange(1000, dtype=torch.float32)
    with incluster.Checkpointer(job="flaky", local_dir=ram, writer="thread", persistent=tier) as ck:
        h = ck.save(2, {"w": want.clone()})
        h.wait(60)
        assert h.persisted.result(60)
    shutil.rmtree(ram)  # the node's RAM is lost
    read = P.FsspecTier.read

    def reset(self, path, into=None):
        if path.endswith(".safetensors"):
            raise ConnectionResetError(104, "Connection reset by peer")
        return read(self, path, into)

    monkeypatch.setattr(P.FsspecTier, "read", reset)
    state = {"w": torch.zeros(1000)}
    with incluster.Checkpointer(job="flaky", local_dir=ram, writer="thread", persistent=tier) as ck:
        with pytest.raises(incluster.TierUnavailableError, match="reading it from the persistent tier failed"):
            ck.load(state)
    monkeypatch.setattr(P.FsspecTier, "read", read)  # the tier answers again: the step is still there
    with incluster.Checkpointer(job="flaky", local_dir=ram, writer="thread", persistent=tier) as ck:
        assert ck.load(state) == 2 and torch.equal(state["w"], want)


def test_a_tensor_where_a_module_was_saved_says_a_module_was_saved(local_dir):
    _save(local_dir, {"model": torch.nn.Linear(4, 4)})
    with pytest.raises(CheckpointError, match=r"model: the checkpoint holds a torch Module's state here, but the "
                                              r"live state has a tensor"):
        _load(local_dir, {"model": torch.zeros(4)})


def test_load_of_something_that_is_not_a_dict_says_so_as_save_does(local_dir):
    _save(local_dir, {"model": torch.nn.Linear(4, 4)})
    with incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread") as ck:
        with pytest.raises(CheckpointError, match="state must be a dict of named parts"):
            ck.load([torch.nn.Linear(4, 4)])
        assert ck.load({"model": torch.nn.Linear(4, 4)}) == 1  # and the next load() is a load as usual
