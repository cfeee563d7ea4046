"""Who is saving, and under which job: a multi-rank process without a process group is
refused, the job name never defaults to one unrelated runs share, and only what is
saved is copied."""

from __future__ import annotations

import sys

import pytest
import torch

import incluster
from incluster.config import default_job
from incluster.state import snapshot, view_key


def test_a_rank_of_a_multi_rank_job_without_a_process_group_is_refused(local_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(incluster.CheckpointError, match="init_process_group"):
        incluster.Checkpointer(local_dir=local_dir, job="j")


def test_the_default_job_is_never_torchruns_none_and_follows_the_script(monkeypatch, tmp_path):
    monkeypatch.delenv("INCLUSTER_JOB", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default rendezvous id
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", str(tmp_path / "train.py"), raising=False)
    monkeypatch.chdir(tmp_path)
    a = default_job()
    assert a.startswith("train-") and a not in ("none", "default")
    assert default_job() == a  # a restart of the same launch resumes
    monkeypatch.setattr(main, "__file__", str(tmp_path / "other" / "train.py"))
    assert default_job() != a  # another script (of the same name) does not share it
    monkeypatch.setattr(main, "__file__", str(tmp_path / "train.py"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    multi = default_job()
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert default_job() != multi  # another rendezvous: another job
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-42")
    assert default_job() == "run-42"
    assert incluster.config.resolve(local_dir=str(tmp_path)).job == "run-42"


def test_an_empty_job_name_is_refused_not_replaced(local_dir, monkeypatch):
    # job="" is a setting left blank by mistake: saving under a derived name instead would
    # hide the mistake until a relaunch that spells the name finds no checkpoints
    monkeypatch.setenv("INCLUSTER_JOB", "")  # a blank variable is unset
    with pytest.raises(ValueError, match="job '' must be 1-128 characters"):
        incluster.Checkpointer(local_dir=local_dir, job="")
    assert incluster.config.resolve(local_dir=local_dir).job == default_job()


def test_non_persistent_buffers_are_not_copied_at_save_time():
    m = torch.nn.Linear(4, 4)
    m.register_buffer("cache", torch.zeros(1000), persistent=False)
    m.register_buffer("stat", torch.zeros(3))
    snap, _, _ = snapshot({"m": m})
    captured = snap.tree["m"]
    assert view_key(m.stat) in captured.buffers
    assert view_key(m.cache) not in captured.buffers


def test_an_empty_restore_under_a_derived_job_name_says_how_to_resume(local_dir, monkeypatch, caplog):
    monkeypatch.delenv("INCLUSTER_JOB", raising=False)
    state = {"w": torch.zeros(3)}
    with caplog.at_level("WARNING", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, writer="thread") as ck:
            assert ck.load(state) is None
    assert any("pass job=" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, writer="thread", job="named") as ck:
            assert ck.load(state) is None
    assert not any("pass job=" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")  # torchrun --rdzv-id run-7: named, not derived
    with caplog.at_level("INFO", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, writer="thread") as ck:
            assert ck.config.job == "run-7" and ck.load(state) is None
    assert not any("derived" in r.getMessage() or "pass job=" in r.getMessage() for r in caplog.records)
    caplog.clear()
    rid = "0d5c8a3e-7f41-4c2b-9a51-3b8e2f6d1c07"  # torchrun draws a run id per one-node launch
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", rid)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with caplog.at_level("INFO", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, writer="thread") as ck:
            assert ck.config.job != rid and ck.load(state) is None
    said = [r.getMessage() for r in caplog.records]
    assert any("drew run id" in m and "--rdzv-endpoint" in m and "pass job=" in m for m in said), said


def test_an_empty_restore_under_a_derived_job_name_names_the_jobs_the_folder_holds(local_dir, monkeypatch, caplog):
    """A relaunch whose derived name changed (another rendezvous port) found nothing and
    said only that; the earlier launch's steps sat in the same folder under their name."""
    monkeypatch.delenv("INCLUSTER_JOB", raising=False)
    with incluster.Checkpointer(local_dir=local_dir, writer="thread", job="train-0532abab") as ck:
        for step in (5, 10):
            ck.save(step, {"w": torch.zeros(3)}).wait()
    with caplog.at_level("WARNING", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, writer="thread") as ck:
            assert ck.load({"w": torch.ones(3)}) is None
    said = [r.getMessage() for r in caplog.records if "pass job=" in r.getMessage()]
    assert len(said) == 1 and f"{local_dir} holds job 'train-0532abab' (newest step 10)" in said[0], said


def test_a_one_node_torchrun_job_gets_the_same_name_at_every_launch(monkeypatch, tmp_path):
    """torchrun draws a new run id (and port) at every one-node launch, --rdzv-id or not:
    the name comes from the script and folder instead, so a relaunch resumes; a run id
    given on a multi-node rendezvous still names the job."""
    monkeypatch.delenv("INCLUSTER_JOB", raising=False)
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", str(tmp_path / "train.py"), raising=False)
    monkeypatch.chdir(tmp_path)
    names = set()
    for rid, port in (("0d5c8a3e-7f41-4c2b-9a51-3b8e2f6d1c07", "41743"), ("875fa357-ee99-4c5f-aad3-8523a159f653", "39643")):
        for var, value in (("TORCHELASTIC_RUN_ID", rid), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
            monkeypatch.setenv(var, value)
        names.add(default_job())
    assert len(names) == 1 and names.pop().startswith("train-")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two nodes: an explicit --rdzv-id is the name
    assert default_job() == "875fa357-ee99-4c5f-aad3-8523a159f653"


def test_a_mistyped_environment_variable_is_named_with_the_one_meant(monkeypatch, caplog, local_dir):
    from incluster import config

    monkeypatch.setenv("INCLUSTER_LOCALDIR", "/somewhere")
    monkeypatch.setattr(config, "_env_warned", set())
    with caplog.at_level("WARNING", logger="incluster"):
        config.resolve(local_dir=local_dir, job="j")
        config.resolve(local_dir=local_dir, job="j")
    said = [r.getMessage() for r in caplog.records if "INCLUSTER_LOCALDIR" in r.getMessage()]
    assert len(said) == 1 and "did you mean INCLUSTER_LOCAL_DIR?" in said[0]


def test_persistent_tier_options_without_a_tier_are_named(monkeypatch, caplog, local_dir):
    from incluster import config

    monkeypatch.delenv("INCLUSTER_PERSISTENT", raising=False)
    monkeypatch.setattr(config, "_env_warned", set())
    with caplog.at_level("WARNING", logger="incluster"):
        config.resolve(local_dir=local_dir, job="j", persistent_every=2)
        config.resolve(local_dir=local_dir, job="j", persistent_every=2)
        config.resolve(local_dir=local_dir, job="j")  # the defaults: nothing to say
        config.resolve(local_dir=local_dir, job="j", persistent=str(local_dir), persistent_every=2)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "persistent_every=2 given, but there is no persistent tier" in said[0], said
    assert "persistent=<path or URL>" in said[0]
