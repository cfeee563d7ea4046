"""One run uploads a job's steps at a time: a run replaced by a later launch of the job
(a node thought dead, an allocation never ended) while it still trains stops uploading,
and never deletes the later run's steps."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import incluster
from incluster import commit


def _state(v: float) -> dict:
    return {"w": torch.full((4000,), v)}


def _manifests(root: str) -> list[int]:
    job = os.path.join(root, "p")
    return sorted(int(n[5:]) for n in os.listdir(job) if os.path.exists(os.path.join(job, n, "COMMITTED.json")))


def test_a_run_another_launch_took_over_uploads_no_more_and_deletes_none_of_its_steps(local_dir, tmp_path,
                                                                                      monkeypatch, caplog):
    root = str(tmp_path / "persist")
    kw = dict(job="p", writer="thread", persistent=root, persistent_every=1, persistent_keep=2)
    old = incluster.Checkpointer(local_dir=local_dir, **kw)
    new_dir = str(tmp_path / "other-node")  # RAM of the nodes the later launch got
    os.makedirs(new_dir)
    try:
        for step in (1, 2):
            assert old.save(step, _state(float(step))).persisted.result(60)
        monkeypatch.setattr(commit, "_run_id", "the-later-launch")
        with incluster.Checkpointer(local_dir=new_dir, **kw) as new:
            target = _state(0.0)
            assert new.load(target) == 2 and torch.equal(target["w"], _state(2.0)["w"])
            assert old.save(3, _state(-3.0)).persisted.result(60)  # the leftover still owns the tier
            caplog.clear()
            assert new.save(3, _state(3.0)).persisted.result(60)
            said = [r.getMessage() for r in caplog.records if "still trains" in r.getMessage()]
            assert len(said) == 1 and "uploaded step 3 after this run started" in said[0], said
            owner = json.load(open(os.path.join(root, "p", "RUN.json")))
            assert owner["run"] == "the-later-launch" and owner["pid"] == os.getpid()
            for step in (4, 5):  # the leftover run goes on training
                h = old.save(step, _state(-float(step)))
                h.wait()  # its own RAM copies still commit
                with pytest.raises(incluster.CheckpointError, match=r"another run of job 'p' took over its "
                                   r"persistent tier \(host .*run the-later-la, since .* UTC\): step \d is not "
                                   r"uploaded. Stop this run .*delete .*/p/RUN.json"):
                    h.persisted.result(60)
            assert _manifests(root) == [2, 3]  # its steps 4 and 5 would have pushed 3 out
            assert new.save(6, _state(6.0)).persisted.result(60)
        assert _manifests(root) == [3, 6]
    finally:
        old.close()
        shutil.rmtree(new_dir, ignore_errors=True)
    shutil.rmtree(os.path.join(local_dir, "p"))
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(target) == 6 and torch.equal(target["w"], _state(6.0)["w"])


def test_a_later_run_takes_the_job_over_from_one_that_ended(local_dir, tmp_path, monkeypatch):
    """The usual restart: the new run claims the job at its first upload and goes on."""
    root = str(tmp_path / "persist")
    kw = dict(job="p", writer="thread", persistent=root, persistent_every=1)
    with incluster.Checkpointer(local_dir=local_dir, **kw) as ck:
        assert ck.save(1, _state(1.0)).persisted.result(60)
    monkeypatch.setattr(commit, "_run_id", "restarted")
    with incluster.Checkpointer(local_dir=local_dir, **kw) as ck:
        assert ck.load(_state(0.0)) == 1
        for step in (2, 3):
            assert ck.save(step, _state(float(step))).persisted.result(60)
    assert json.load(open(os.path.join(root, "p", "RUN.json")))["run"] == "restarted"


def test_a_leftover_runs_restarted_writer_does_not_take_the_job_back(tmp_path):
    """The fence holds for a writer started again in the leftover run, which has not
    claimed the job itself: the run that started later owns it."""
    from incluster.tier_steps import TierSteps
    from incluster.tiers.persistent import open_tier

    tier = open_tier(str(tmp_path / "persist"))
    old, new = TierSteps(tier, "p", "old"), TierSteps(tier, "p", "new")
    old.open(1, loaded=False, again=False, began=100)
    new.open(2, loaded=True, again=False, began=200)
    with pytest.raises(incluster.CheckpointError, match="run new"):
        TierSteps(tier, "p", "old").open(3, loaded=True, again=False, began=100)
    with pytest.raises(incluster.CheckpointError, match="retention after step 3 deletes nothing"):
        old.retention(3, 1)
    # a writer started again in a run that had uploaded: it owned the record, whatever the clocks say
    with pytest.raises(incluster.CheckpointError, match="run new"):
        TierSteps(tier, "p", "old", owned=True).open(3, loaded=True, again=False, began=10**20)
    new.open(3, loaded=True, again=False, began=200)  # the owner goes on
    assert json.loads(bytes(tier.read("p/RUN.json")))["run"] == "new"


def test_a_leftover_runs_rollback_does_not_set_the_later_runs_steps_aside(tmp_path, caplog):
    """load(step=N) sets the tier's newer steps aside; in a run a later one took the job
    over from, they are that run's steps."""
    from incluster.recovery.from_persistent import abandon_in_tier
    from incluster.tier_layout import list_steps
    from incluster.tier_steps import TierSteps
    from incluster.tiers.persistent import open_tier

    tier = open_tier(str(tmp_path / "persist"))
    TierSteps(tier, "p", "new").open(5, loaded=True, again=False, began=200)
    for step in (4, 5):
        tier.write(f"p/step-{step:012d}/COMMITTED.json", memoryview(b"{}"))
    abandon_in_tier(tier, "p", 3, "old", 100)
    assert list_steps(tier, "p") == {5: True, 4: True}
    assert "its steps newer than step 3 are kept" in caplog.text
    abandon_in_tier(tier, "p", 4, "new", 200)  # the owner's own rollback goes ahead
    assert list_steps(tier, "p") == {5: False, 4: True}


def test_a_half_written_owner_record_a_killed_run_left_is_swept(local_dir, tmp_path):
    """A run killed while it wrote RUN.json left RUN.json.tmp-PID in the tier for good (no
    later run removed it, and nothing listed it). One older than a live write could be
    goes at the next retention; a fresh one - maybe another run's write under way - stays.
    Age is taken against the owner record's time, both the file server's clock."""
    root = str(tmp_path / "persist")
    os.makedirs(os.path.join(root, "p"), mode=0o700)
    stale, fresh = (os.path.join(root, "p", f"RUN.json.tmp-{pid}") for pid in (4029, 4030))
    for path in (stale, fresh):
        with open(path, "w") as f:
            f.write('{"run": "cut sho')
    os.utime(stale, (1e9, 1e9))
    odd = os.path.join(root, "p", "export.tmp-7")  # not a file write() makes: never touched, nor in the way
    os.makedirs(odd)
    os.utime(odd, (1e9, 1e9))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1, persistent_keep=2) as ck:
        for step in (1, 2, 3):
            assert ck.save(step, _state(float(step))).persisted.result(60)
    assert not os.path.exists(stale) and os.path.exists(fresh) and os.path.isdir(odd)
    assert _manifests(root) == [2, 3]  # retention went on


def test_the_owner_record_names_the_training_process_not_its_writer(local_dir, tmp_path):
    """The record (and the take-over messages quoting it) named the writer process that
    uploads: stopping that pid only had the writer started again, the leftover trained on."""
    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", persistent=root, persistent_every=1) as ck:
        assert ck.save(1, _state(1.0)).persisted.result(60)
        writer = ck.writer_pid
    owner = json.load(open(os.path.join(root, "p", "RUN.json")))
    assert owner["pid"] == os.getpid() != writer, (owner, writer)
