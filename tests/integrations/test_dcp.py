"""DCP interop: ``incluster export --to dcp`` writes a folder ``dcp.load`` reads (resharded
to another layout), and a job starts from a DCP checkpoint and goes on with incluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import incluster
from incluster.integrations.dcp import load_dcp
from incluster.testing.launch import launch

SCRIPT = os.path.join(os.path.dirname(__file__), "dcp_script.py")


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def train(m: torch.nn.Module, o: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x, y = batch(s)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = model(seed=99)  # different weights: everything must come from the checkpoint
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def test_export_to_dcp_is_read_by_dcp_load(local_dir, tmp_path):
    m = model()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    train(m, o, range(3))
    with incluster.Checkpointer(local_dir=local_dir, job="exp") as ck:
        ck.save(3, {"model": m, "optim": o, "extra": {"tokens": 4096, "lr": 0.5, "tag": "x"}}).wait()
    out = str(tmp_path / "dcp")
    proc = subprocess.run([sys.executable, "-m", "incluster", "export", local_dir, "--step", "3", "--to", "dcp", out],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exported" in proc.stdout and os.path.exists(os.path.join(out, ".metadata"))

    # Plain DCP, no incluster on the loading side: the model's keys are where dcp.load looks.
    plain = model(seed=5)
    dcp.load({"model": plain}, checkpoint_id=out)
    for (k, a), b in zip(m.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k

    # load_dcp with an optimizer that has never stepped: its moments come back too.
    m2, o2 = fresh()
    extra: dict = {}
    state = {"model": m2, "optim": o2, "extra": extra}
    assert load_dcp(state, out, step=3) == 3
    assert extra == {"tokens": 4096, "lr": 0.5, "tag": "x"}
    assert len(o2.state) == len(o.state)
    for p, q in zip(o.state.values(), o2.state.values()):
        for k in p:
            assert torch.equal(p[k], q[k]), k
    assert train(m2, o2, range(3, 6)) == train(m, o, range(3, 6))

    again = subprocess.run([sys.executable, "-m", "incluster", "export", local_dir, "--step", "3", "--to", "dcp", out],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stdout + again.stderr


def test_a_job_starts_from_dcp_and_continues_with_incluster(local_dir, tmp_path):
    m, o = model(), None
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    reference = train(m, o, range(8))

    m, o = model(), None
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    train(m, o, range(4))
    seed = str(tmp_path / "seed")
    dcp.save({"model": m, "optim": o, "extra": {"tokens": 4}}, checkpoint_id=seed)  # written by DCP itself

    m2, o2 = fresh()
    state = {"model": m2, "optim": o2, "extra": {"tokens": 0}}
    with incluster.Checkpointer(local_dir=local_dir, job="seeded") as ck:
        start = ck.load(state)
        assert start is None
        start = load_dcp(state, seed, step=3)
        assert state["extra"] == {"tokens": 4}
        losses = train(m2, o2, range(start + 1, 6))
        ck.save(5, state).wait()
    assert losses == reference[4:6]

    m3, o3 = fresh()  # a restart now finds incluster's own step 5
    state3 = {"model": m3, "optim": o3, "extra": {"tokens": 0}}
    with incluster.Checkpointer(local_dir=local_dir, job="seeded") as ck:
        assert ck.load(state3) == 5
    assert train(m3, o3, range(6, 8)) == reference[6:8]


def test_load_dcp_fills_an_empty_dict_with_lists_as_lists(tmp_path):
    """A list under an empty dict came back as a dict with int keys holding None beside str
    keys holding the values (a Lightning export's ``lr_schedulers`` read that way)."""
    saved = {"scheds": [{"last_epoch": 7, "lrs": [0.1, 0.2]}, {"last_epoch": 3, "lrs": []}],
             "w": [torch.arange(3.0), {"b": torch.ones(2)}], "n": 5, "gaps": [{}, {"c": torch.ones(1)}, None, []]}
    path = str(tmp_path / "lists")
    dcp.save({"extra": saved}, checkpoint_id=path)
    live: dict = {"extra": {}}
    load_dcp(live, path)
    got = live["extra"]
    assert got["scheds"] == saved["scheds"] and got["n"] == 5, got
    assert isinstance(got["w"], list) and torch.equal(got["w"][0], saved["w"][0]), got
    assert torch.equal(got["w"][1]["b"], torch.ones(2)), got
    # an empty dict in a list: DCP stores no key for it, and dcp.load refused it even in the saved structure
    assert got["gaps"][0] == {} and torch.equal(got["gaps"][1]["c"], torch.ones(1)) and got["gaps"][2:] == [None, []]
    same = {"extra": {**saved, "gaps": [{}, {"c": torch.zeros(1)}, None, []]}}
    load_dcp(same, path)
    assert torch.equal(same["extra"]["gaps"][1]["c"], torch.ones(1))
    shorter = {"extra": {**saved, "gaps": []}}  # a live list the filling extends
    load_dcp(shorter, path)
    assert shorter["extra"]["gaps"][0] == {} and torch.equal(shorter["extra"]["gaps"][1]["c"], torch.ones(1))


def test_load_dcp_into_a_plain_optimizer_state_dict_loads_its_int_keyed_state(tmp_path):
    """DCP names an optimizer state's int keys as their str(): the filling took "0" for a
    missing key, added a str-keyed entry beside the live int-keyed one and DCP loaded into
    that - the live moments stayed stale and load_state_dict() got junk keys."""
    m, o = fresh()
    train(m, o, range(2))
    path = str(tmp_path / "optim")
    dcp.save({"model": m.state_dict(), "optim": o.state_dict()}, checkpoint_id=path)
    m2, o2 = fresh()
    train(m2, o2, range(1))
    live = {"model": m2.state_dict(), "optim": o2.state_dict()}
    load_dcp(live, path)
    assert sorted(live["optim"]["state"]) == sorted(o.state_dict()["state"]), live["optim"]["state"].keys()
    for k, s in o.state_dict()["state"].items():
        assert torch.equal(live["optim"]["state"][k]["exp_avg"], s["exp_avg"]), k


def test_load_dcp_names_what_does_not_match(tmp_path):
    m, o = fresh()
    path = str(tmp_path / "c")
    dcp.save({"model": m, "sched": {"epoch": 2}}, checkpoint_id=path)
    with pytest.raises(incluster.CheckpointError, match=r"\['sched'\].*strict=False"):
        load_dcp({"model": model()}, path)
    only = {"model": model(seed=3)}
    load_dcp(only, path, strict=False)
    assert torch.equal(only["model"][0].weight, m[0].weight)
    # the keys under the entry that does not match, not the top-level names (which include it)
    with pytest.raises(incluster.CheckpointError, match=r"failed: RuntimeError: Missing key in checkpoint state_dict: "
                       r"model\.weight\. Under 'model' it holds: model\.0\.bias, model\.0\.weight"):
        load_dcp({"model": torch.nn.Linear(2, 2), "sched": {"epoch": 0}}, path)
    with pytest.raises(incluster.NoCheckpointError, match="no DCP checkpoint"):
        load_dcp({"model": model()}, str(tmp_path / "absent"))


def test_load_dcp_says_which_tensors_it_cast_and_warns_where_values_are_lost(tmp_path, caplog):
    m = model()
    path = str(tmp_path / "fp32")
    dcp.save({"model": m}, checkpoint_id=path)
    narrow = model(seed=5).to(torch.bfloat16)
    with caplog.at_level("INFO", logger="incluster"):
        load_dcp({"model": narrow}, path)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "load_dcp cast" in r.getMessage()]
    assert warned and "float32 -> bfloat16" in warned[0] and "0.weight" in warned[0], warned
    assert torch.equal(narrow[0].weight, m[0].weight.to(torch.bfloat16))  # DCP's cast, as loaded
    caplog.clear()
    half = str(tmp_path / "bf16")
    dcp.save({"model": model(seed=2).to(torch.bfloat16)}, checkpoint_id=half)
    with caplog.at_level("INFO", logger="incluster"):
        load_dcp({"model": model(seed=6)}, half)  # bf16 into fp32: exact, said at INFO only
    said = [r for r in caplog.records if "load_dcp cast" in r.getMessage()]
    assert said and all(r.levelname == "INFO" and "exactly" in r.getMessage() for r in said), said
    caplog.clear()
    with caplog.at_level("INFO", logger="incluster"):
        load_dcp({"model": model(seed=6)}, path)  # same dtypes: nothing said
    assert not [r for r in caplog.records if "load_dcp cast" in r.getMessage()]


def test_top_level_names_with_dots(tmp_path):
    """A flat model.state_dict() at the top level, as torchtitan and plain DCP users save."""
    m = model()
    path = str(tmp_path / "flat")
    dcp.save({**m.state_dict(), "extra": {"tokens": 3}}, checkpoint_id=path)
    target = model(seed=7)
    live = {**target.state_dict(), "extra": {"tokens": 0}}
    load_dcp(live, path)
    for k, v in m.state_dict().items():
        assert torch.equal(live[k], v), k
    assert live["extra"] == {"tokens": 3}
    part = {"0.weight": torch.zeros(16, 8)}
    load_dcp(part, path, strict=False)
    assert torch.equal(part["0.weight"], m[0].weight)


def test_export_refuses_pickled_values_for_dcp(local_dir, tmp_path):
    with incluster.Checkpointer(local_dir=local_dir, job="pk", allow_pickle=True) as ck:
        ck.save(1, {"w": torch.ones(3), "obj": {1, 2}}).wait()
    out = str(tmp_path / "d")
    proc = subprocess.run([sys.executable, "-m", "incluster", "export", local_dir, "--step", "1", "--to", "dcp", out],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "pickled" in proc.stdout, proc.stdout + proc.stderr
    assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if n.startswith("d.partial")]


@pytest.mark.multiproc
def test_dtensor_shards_export_and_reshard(local_dir, tmp_path):
    out = str(tmp_path)
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(150)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    export = open(os.path.join(out, "export.txt")).read()
    assert export.startswith("0\n"), export
    for r in range(2):
        res = json.load(open(os.path.join(out, f"result-r{r}.json")))
        assert res["w"] and res["b"], res
        assert res["local_w_shape"] == [7, 3], res  # Shard(1) now, not the saved Shard(0)
        assert res["extra"] == {"tokens": 1000, "name": "run"}, res  # the lowest rank's value
    # ... and a single process reads the same folder into plain full tensors.
    live = {"w": torch.zeros(7, 6), "b": torch.zeros(6), "extra": {}}
    load_dcp(live, os.path.join(out, "dcp"))
    assert torch.equal(live["w"], torch.arange(42, dtype=torch.float32).reshape(7, 6) / 7)


def test_an_optimizer_saved_by_parameter_name_is_named_with_the_way_to_load_it(tmp_path):
    """torchtitan and get_state_dict() key the optimizer state by parameter name; loading
    that into an Optimizer failed with DCP's "Missing key ... optim.state.0.step" and no fix."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m = model()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, o, range(2))
    msd, osd = get_state_dict(m, o)
    path = str(tmp_path / "by-name")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    m2, o2 = fresh()
    with pytest.raises(incluster.CheckpointError, match=r"\['optim'\] key\(s\) optimizer state by parameter name.*"
                                                        r"get_state_dict\(model, optim\).*set_state_dict"):
        load_dcp({"model": m2, "optim": o2}, path)
    m2, o2 = fresh()
    msd2, osd2 = get_state_dict(m2, o2)  # gives a fresh optimizer its state keys, by name
    load_dcp({"model": msd2, "optim": osd2}, path)  # what the message says
    set_state_dict(m2, o2, model_state_dict=msd2, optim_state_dict=osd2)
    assert train(m2, o2, range(2, 5)) == train(m, o, range(2, 5))
