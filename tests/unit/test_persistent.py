"""The persistent tier through the Checkpointer: every Nth step, manifests, retention,
restores when the cluster's RAM is gone, failures that never stop training."""

from __future__ import annotations

import json
import os
import re
import time
import shutil
import uuid

import pytest
import torch

import incluster
from incluster.testing import FaultInjector

import s3server


def _state(v: float) -> dict:
    return {"w": torch.full((5000,), v), "extra": {"v": v}}


def _run(local_dir, persistent, steps, writer="thread", **kw):
    handles = {}
    with incluster.Checkpointer(
        local_dir=local_dir, job="p", writer=writer, persistent=persistent, persistent_every=2, **kw
    ) as ck:
        for step in steps:
            handles[step] = ck.save(step, _state(float(step)))
            handles[step].wait()
            try:
                handles[step].persisted.result(60)  # one upload at a time: let it finish
            except incluster.TierUnavailableError:
                pass
    return handles


def _manifests(root, job="p"):
    return sorted(n for n in os.listdir(os.path.join(root, job)) if os.path.exists(os.path.join(root, job, n, "COMMITTED.json")))


def test_every_nth_step_is_uploaded_with_a_manifest_and_old_ones_retired(local_dir, tmp_path):
    root = str(tmp_path / "persist")
    handles = _run(local_dir, root, range(6), persistent_keep=2)
    assert [h.persisted.result(30) for h in handles.values()] == [True, False, True, False, True, False]
    assert _manifests(root) == ["step-000000000002", "step-000000000004"]
    manifest = json.load(open(os.path.join(root, "p", "step-000000000004", "COMMITTED.json")))
    assert manifest["world_size"] == 1 and manifest["ranks"][0]["rank"] == 0
    assert manifest["ranks"][0]["size"] == os.path.getsize(os.path.join(root, "p", "step-000000000004", "rank-00000.safetensors"))


def test_ram_lost_restores_from_persistent_and_heals_ram(local_dir, tmp_path):
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(6))
    shutil.rmtree(os.path.join(local_dir, "p"))  # every node's RAM is gone
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(target) == 4
        assert ck.last_restore.source == "persistent"
        assert torch.equal(target["w"], torch.full((5000,), 4.0)) and target["extra"] == {"v": 4.0}
        assert os.path.exists(os.path.join(ck.folder, "step-000000000004.json"))  # healed
        ck.save(5, _state(5.0)).wait()  # and saving goes on from there


def test_a_corrupt_persistent_shard_falls_back_to_the_older_step_and_is_named_once(local_dir, tmp_path, caplog):
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(6), persistent_keep=2)
    shutil.rmtree(os.path.join(local_dir, "p"))
    shard = os.path.join(root, "p", "step-000000000004", "rank-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    target = _state(0.0)
    with caplog.at_level("INFO", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
            assert ck.load(target) == 2 and torch.equal(target["w"], torch.full((5000,), 2.0))
    notes = [r.getMessage() for r in caplog.records if "checksum mismatch" in r.getMessage()]
    where = "rank 0's shard of persistent step 4"
    assert notes and all(n.count(where) == 1 for n in notes), notes


def _flip(root, step):
    shard = os.path.join(root, "p", f"step-{step:012d}", "rank-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


def _restore_from_tier(local_dir, root, expect_step, expect_value, **kw):
    shutil.rmtree(os.path.join(local_dir, "p"), ignore_errors=True)
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root, **kw) as ck:
        assert ck.load(target) == expect_step
        assert torch.equal(target["w"], torch.full((5000,), expect_value))


def _go_on(local_dir, root, loaded, saves):
    """Load (``loaded`` expected), then save each (step, value), each uploaded."""
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1, persistent_keep=2) as ck:
        assert ck.load(_state(0.0)) == loaded
        for step, value in saves:
            h = ck.save(step, _state(value))
            h.wait()
            h.persisted.result(60)


def test_a_persistent_step_found_bad_is_set_aside_for_later_restores_and_retention(local_dir, tmp_path, caplog):
    """The restore that finds step 4's shard bad marks it in the tier: the next restore
    does not download it again, retention keeps usable steps only (a good one is never
    pushed out by the bad one), and a run that saves step 4 again makes it usable."""
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(6), persistent_keep=2)  # steps 2 and 4 in the tier
    _flip(root, 4)
    _restore_from_tier(local_dir, root, 2, 2.0)
    marker = os.path.join(root, "p", "step-000000000004", "SET_ASIDE.json")
    assert "checksum mismatch" in json.load(open(marker))["why"]
    caplog.clear()
    with caplog.at_level("INFO", logger="incluster"):
        _restore_from_tier(local_dir, root, 2, 2.0)
    assert not [r for r in caplog.records if "checksum mismatch" in r.getMessage()]  # not downloaded again
    _go_on(local_dir, root, 2, [(6, 6.0)])  # retention keeps 6 and 2, not 6 and the bad 4
    _flip(root, 6)
    _restore_from_tier(local_dir, root, 2, 2.0)
    _go_on(local_dir, root, 2, [(4, 40.0)])  # step 4 saved again: its marker goes with its old manifest
    assert not os.path.exists(marker)
    _restore_from_tier(local_dir, root, 4, 40.0)


def test_a_download_this_node_could_not_take_does_not_set_the_tiers_step_aside(local_dir, tmp_path, monkeypatch):
    """A full RAM disk is this node's problem, not the copy's: the step is passed over in
    this restore only, and the next restore takes it."""
    import errno

    from incluster.staging.slots import SlotRing

    root = str(tmp_path / "persist")
    _run(local_dir, root, range(6), persistent_keep=2)  # steps 2 and 4 in the tier
    prepare, calls = SlotRing.prepare, []

    def full_once(self, slot, size):
        calls.append(size)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return prepare(self, slot, size)

    monkeypatch.setattr(SlotRing, "prepare", full_once)
    _restore_from_tier(local_dir, root, 2, 2.0)
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(root, "p", "step-000000000004", "SET_ASIDE.json"))
    _restore_from_tier(local_dir, root, 4, 4.0)


def test_in_cluster_copy_is_preferred_when_as_new(local_dir, tmp_path):
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(5))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(_state(0.0)) == 4 and ck.last_restore.source == "local"


def test_s3_through_a_real_s3_protocol_server(local_dir, s3_endpoint):
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    s3server.make_bucket(s3_endpoint, bucket)
    url, opts = f"s3://{bucket}/run-7", s3server.options(s3_endpoint)
    handles = _run(local_dir, url, range(4), writer="process", persistent_options=opts)
    assert handles[2].persisted.result(60) is True
    shutil.rmtree(os.path.join(local_dir, "p"))
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=url, persistent_options=opts) as ck:
        assert ck.load(target) == 2 and ck.last_restore.source == "persistent"
    assert torch.equal(target["w"], torch.full((5000,), 2.0))


def test_a_bucket_that_does_not_exist_is_named_never_created_nor_taken_for_an_empty_tier(local_dir, s3_endpoint):
    """A mistyped bucket: uploads fail naming it (fsspec would have created it and kept
    every checkpoint there), and a restart with nothing in RAM raises instead of starting
    afresh beside the checkpoints the real bucket holds."""
    import boto3

    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    url, opts = f"s3://{bucket}/run", s3server.options(s3_endpoint)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=url,
                                persistent_options=opts, persistent_every=1) as ck:
        h = ck.save(0, _state(0.0))
        h.wait(30)
        with pytest.raises(incluster.TierUnavailableError, match=f"bucket '{bucket}'.*does not exist.*never creates"):
            h.persisted.result(60)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                      region_name="us-east-1")
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    shutil.rmtree(os.path.join(local_dir, "p"))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=url,
                                persistent_options=opts) as ck:
        with pytest.raises(incluster.TierUnavailableError, match="does not exist") as got:
            ck.load(_state(1.0))
    said = str(got.value)  # two sentences, not one spliced onto the other's closing parenthesis
    assert "credentials). No complete step is in the cluster's RAM either: nothing is loaded" in said, said


def test_failed_upload_is_reported_and_training_goes_on(local_dir, tmp_path, monkeypatch):
    root = str(tmp_path / "persist")
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="upload", step=2).env().items())))
    handles = _run(local_dir, root, range(5), run_dir=str(tmp_path / "events"))
    with pytest.raises(incluster.TierUnavailableError, match="step 2"):
        handles[2].persisted.result(30)
    assert handles[2].durable.done() and handles[4].persisted.result(30) is True
    assert _manifests(root) == ["step-000000000000", "step-000000000004"]
    from incluster.goodput.reader import read_run
    from incluster.goodput.report import checkpoint_stats

    stats = checkpoint_stats(read_run(tmp_path / "events"))  # the goodput report shows it too
    assert (stats.persist_failures, stats.persist_skips, stats.save_failures) == (1, 0, 0)


def test_a_persistent_save_due_while_the_previous_uploads_is_skipped(local_dir, tmp_path, monkeypatch):
    import time

    from incluster.tiers.persistent import FsspecTier

    slow = FsspecTier.write

    def write(self, path, data, **kw):
        time.sleep(0.5)
        return slow(self, path, data, **kw)

    monkeypatch.setattr(FsspecTier, "write", write)
    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root, persistent_every=1) as ck:
        first = ck.save(0, _state(0.0))
        first.wait()
        second = ck.save(1, _state(1.0))  # due while step 0 is still uploading
        second.wait()
        assert second.persisted.result(30) is False
        assert first.persisted.result(30) is True
        assert _manifests(root) == ["step-000000000000"]
    assert _manifests(root) == ["step-000000000000", "step-000000000001"]  # close() caught the tier up


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_save_persist_true_uploads_off_schedule_and_false_never(local_dir, tmp_path, writer):
    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer=writer, persistent=root,
                                persistent_every=100) as ck:
        handles = [ck.save(0, _state(0.0), persist=False),  # due by the schedule (the run's first save)
                   ck.save(1, _state(1.0)),  # not due
                   ck.save(2, _state(2.0), persist=True)]  # not due, asked for
        assert [h.wait() or h.persisted.result(30) for h in handles] == [False, False, True]
    assert _manifests(root) == ["step-000000000002"]
    with incluster.Checkpointer(local_dir=local_dir, job="q", writer="thread") as ck:
        with pytest.raises(ValueError, match=r"persist=True\) needs a persistent tier: pass persistent="):
            ck.save(1, _state(1.0), persist=True)


def _slow_tier_writes(monkeypatch, seconds):
    from incluster.tiers.persistent import FsspecTier

    slow = FsspecTier.write

    def write(self, path, data, **kw):
        time.sleep(seconds)
        return slow(self, path, data, **kw)

    monkeypatch.setattr(FsspecTier, "write", write)


def test_save_persist_true_waits_for_the_upload_before_it_and_scheduled_ones_skip_meanwhile(local_dir, tmp_path,
                                                                                           monkeypatch):
    _slow_tier_writes(monkeypatch, 0.3)
    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1, persistent_keep=3) as ck:
        first = ck.save(0, _state(0.0))
        first.wait()
        last = ck.save(1, _state(1.0), persist=True)  # while step 0 uploads: waits for it, never skipped
        last.wait()
        between = ck.save(2, _state(2.0))  # due, while step 1 waits: skipped (uploads stay in step order)
        between.wait()
        assert between.persisted.result(30) is False
        assert first.persisted.result(30) is True and last.persisted.result(30) is True
        assert _manifests(root) == ["step-000000000000", "step-000000000001"]
    assert _manifests(root)[-1] == "step-000000000002"  # close() caught the tier up


def test_forced_saves_on_a_slow_tier_never_pin_every_slot_nor_leave_threads(local_dir, tmp_path, monkeypatch):
    """Each save(persist=True) waiting for the upload that runs pinned its slot: three in
    a row on a slow tier pinned all keep+1, and the next save timed out (its RAM copy lost).
    One waits at most; a newer one replaces it. No thread outlives its Checkpointer."""
    import threading

    _slow_tier_writes(monkeypatch, 0.5)
    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1, persistent_keep=3, slot_timeout_s=1.0) as ck:
        handles = [ck.save(0, _state(0.0))] + [ck.save(s, _state(float(s)), persist=True) for s in (1, 2, 3)]
        for h in handles:
            h.wait()  # the save of step 3 found every slot pinned (step 0's upload takes 1.5 s)
        assert ck.save(4, _state(4.0), persist=False).wait() is None
        assert [h.persisted.result(30) for h in handles] == [True, False, False, True]
    assert _manifests(root) == ["step-000000000000", "step-000000000003"]
    time.sleep(1.0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("incluster-persist-wait")]


def test_close_reports_a_forced_upload_still_waiting_as_not_persisted(local_dir, tmp_path, monkeypatch):
    _slow_tier_writes(monkeypatch, 1.0)
    root = str(tmp_path / "persist")
    ck = incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1, slot_timeout_s=1.0)
    ck.save(0, _state(0.0)).wait()
    last = ck.save(1, _state(1.0), persist=True)
    last.wait()
    t0 = time.monotonic()
    ck.close()
    assert time.monotonic() - t0 < 10
    with pytest.raises(incluster.TierUnavailableError, match="step 1 \\(persist=True\\) waited for the upload"):
        last.persisted.result(10)
    time.sleep(3)  # the upload close() gave up on ends: it must not start step 1's after all
    assert "step-000000000001" not in _manifests(root)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_step_saved_again_after_a_load_gets_its_own_upload_word(local_dir, tmp_path, writer):
    """Step 4 is still uploading when a load() goes back to step 2 and step 4 is saved
    again: that save's upload is skipped (the old one runs). Keyed by step alone, the
    skip was taken for the old upload's word and the old upload's end for the new save's:
    the new step 4 was said to be in the persistent tier, and the old handle was not."""
    from incluster.testing import SlowTier
    from incluster.tiers.persistent import FsspecTier

    root = str(tmp_path / "persist")
    tier = SlowTier(FsspecTier(root), latency_s=0.5)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer=writer, persistent=tier,
                                persistent_every=1) as ck:
        first = ck.save(2, _state(2.0))
        assert first.persisted.result(30) is True
        old = ck.save(4, _state(4.0))
        old.wait()
        os.remove(os.path.join(local_dir, "p", "rank-00000", f"step-{4:012d}.json"))  # step 4 unusable here
        assert ck.load(_state(0.0)) == 2 and not old.persisted.done()
        again = ck.save(4, _state(5.0))
        again.wait()
        assert again.persisted.result(30) is False  # skipped: the old upload of step 4 still ran
        assert old.persisted.result(30) is True


@pytest.mark.multiproc
def test_upload_killed_midway_leaves_no_manifest_and_a_new_writer_uploads_the_next_due_step(local_dir, tmp_path, monkeypatch):
    root = str(tmp_path / "persist")
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="upload", step=2, action="kill").env().items())))
    ck = incluster.Checkpointer(local_dir=local_dir, job="p", persistent=root, persistent_every=2)
    assert ck.save(0, _state(0.0)).persisted.result(60) is True
    ck.save(1, _state(1.0)).wait()
    pid = ck.writer_pid
    h2 = ck.save(2, _state(2.0))  # the writer process dies inside this upload
    with pytest.raises(incluster.TierUnavailableError, match="writer process died during the upload"):
        h2.persisted.result(60)  # its slot is not left pinned for an upload that is gone
    deadline = time.monotonic() + 60
    while ck.writer_pid in (pid, None):  # a new writer takes over
        assert time.monotonic() < deadline, "no new writer process was started"
        time.sleep(0.05)
    monkeypatch.delenv("INCLUSTER_FAULTS")
    ck.save(3, _state(3.0)).wait(60)  # and later saves land
    assert ck.save(4, _state(4.0)).persisted.result(60) is True  # every 2nd save() call, as before
    ck.close()
    assert _manifests(root) == ["step-000000000000", "step-000000000004"]  # step 2 never got one
    shutil.rmtree(os.path.join(local_dir, "p"))
    target = _state(9.0)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(target) == 4
    assert torch.equal(target["w"], torch.full((5000,), 4.0))


def test_the_upload_schedule_follows_save_calls_not_commits(local_dir, tmp_path, monkeypatch):
    """A save whose commit fails still counts: the rank stays on the same every-Nth
    schedule as ranks whose commit of that step worked (else they would upload different
    steps and neither would ever be complete in the tier)."""
    root = str(tmp_path / "persist")
    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="commit", step=2, action="raise").env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root, persistent_every=2) as ck:
        persisted = {}
        for step in range(6):
            h = ck.save(step, _state(float(step)))
            try:
                h.wait()
            except incluster.CommitError:
                assert step == 2
            persisted[step] = h.persisted.result(60)
    # save() calls 0, 2, 4 are due; the commit of 2 failed, so 0 and 4 are uploaded
    assert persisted == {0: True, 1: False, 2: False, 3: False, 4: True, 5: False}
    assert _manifests(root) == ["step-000000000000", "step-000000000004"]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_an_upload_outcome_told_before_the_commit_is_handled_is_not_lost(local_dir, tmp_path, monkeypatch, writer):
    """The writer tells "skipped" right after the commit, so the word can arrive before the
    trainer listens for the step's outcomes. It must still resolve ``persisted`` and leave
    the slot free: a slot pinned as uploading for good made every later save wait."""
    faults = FaultInjector().fail_at(phase="upload", step=0, action="slow", seconds=3.0)
    faults.fail_at(phase="handoff", step=1, action="slow", seconds=1.0)  # the writer's replies come first
    monkeypatch.setenv(*next(iter(faults.env().items())))
    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer=writer, persistent=root, persistent_every=1) as ck:
        first = ck.save(0, _state(0.0))
        first.wait()
        second = ck.save(1, _state(1.0))  # due while step 0 is still uploading: skipped
        second.wait()
        assert second.persisted.result(10) is False
        assert not [s for s in ck.ring.slots if s.step == 1 and s.uploading]
        assert first.persisted.result(30) is True
        for step in (2, 3, 4):  # the ring keeps turning (keep=2: a pinned slot would stop it)
            ck.save(step, _state(float(step))).wait(30)


def test_a_persistent_restore_says_so_in_its_log_line(local_dir, tmp_path):
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(3))
    shutil.rmtree(os.path.join(local_dir, "p"))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(_state(0.0)) == 2
        assert "step 2 from the persistent tier," in ck.last_restore.line()


def test_a_hung_persistent_tier_does_not_hold_up_a_restore_from_ram(local_dir, tmp_path, monkeypatch, caplog):
    """A restart with a complete step in RAM does not wait out an object store that stopped
    answering (its client's own timeouts came to 85 s against a stopped S3 server)."""
    from incluster.recovery import from_persistent
    from incluster.testing.tiers import SlowTier
    from incluster.tiers.persistent import FsspecTier

    root = str(tmp_path / "persist")
    _run(local_dir, root, range(3))
    monkeypatch.setattr(from_persistent, "LIST_TIMEOUT_S", 0.5)
    hung = SlowTier(FsspecTier(root), latency_s=30.0)
    t0 = time.monotonic()
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=hung) as ck:
        assert ck.load(_state(0.0)) == 2 and ck.last_restore.source == "local"
    assert time.monotonic() - t0 < 15
    assert "did not answer a listing within" in caplog.text and "from the cluster's RAM" in caplog.text


def test_an_unreachable_persistent_tier_with_nothing_in_ram_is_an_error_not_a_fresh_start(local_dir, tmp_path):
    """Starting afresh would overwrite progress the tier may well hold."""
    from incluster.testing.tiers import FaultyTier
    from incluster.tiers.persistent import FsspecTier

    root = str(tmp_path / "persist")
    _run(local_dir, root, range(3))
    shutil.rmtree(os.path.join(local_dir, "p"))
    down = FaultyTier(FsspecTier(root), ops=("list",))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=down) as ck:
        with pytest.raises(incluster.TierUnavailableError, match="cannot be listed.*nothing is loaded.*persistent_options"):
            ck.load(_state(0.0))


def test_an_s3_endpoint_refusing_connections_is_a_tier_error_not_a_crash(local_dir, tmp_path):
    """botocore reports a refused connection as its own EndpointConnectionError, not an
    OSError: the restore must still go on from RAM, and the tools must say what failed."""
    from incluster.testing.launch import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": dead, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread") as ck:
        ck.save(0, _state(0.0)).wait()
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent="s3://bkt/run",
                                persistent_options=opts) as ck:
        assert ck.load(_state(1.0)) == 0 and ck.last_restore.source == "local"


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_close_with_an_upload_that_never_ends_is_bounded_and_resolves_persisted(local_dir, tmp_path, monkeypatch,
                                                                                capfd, writer):
    """An object store that stops answering mid-upload: close() waits slot_timeout_s, not
    forever, says what it waits for, and the step's ``persisted`` fails instead of staying
    pending; the writer exits without tearing down the mapping the upload still reads."""
    faults = FaultInjector().fail_at(phase="upload", step=0, action="hang", marker_dir=str(tmp_path))
    monkeypatch.setenv(*next(iter(faults.env().items())))
    root = str(tmp_path / "persist")
    ck = incluster.Checkpointer(local_dir=local_dir, job="p", writer=writer, persistent=root, persistent_every=1,
                                slot_timeout_s=6.0)
    h = ck.save(0, _state(0.0))
    h.wait(30)
    deadline = time.monotonic() + 30
    while not (tmp_path / "fault-upload-r0-s0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    ck.close()
    assert time.monotonic() - t0 < 20
    with pytest.raises(incluster.TierUnavailableError, match="had not finished when close"):
        h.persisted.result(0)
    err = capfd.readouterr().err
    assert "did not finish within" in err and "BufferError" not in err
    assert re.search(r"close\(\) waits up to \d s more for the persistent upload in flight", err), err
    assert not os.path.isdir(os.path.join(root, "p")) or _manifests(root) == []


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_an_upload_close_gave_up_on_writes_no_manifest_when_it_ends_later(local_dir, tmp_path, monkeypatch, writer):
    """close() reports an upload it stopped waiting for as not persisted; with the writer
    on the trainer's threads that upload keeps running, and when its store answers at last
    it must not write the manifest that close() said would not exist."""
    faults = FaultInjector().fail_at(phase="upload", step=0, action="slow", seconds=4.0)
    monkeypatch.setenv(*next(iter(faults.env().items())))
    root = str(tmp_path / "persist")
    ck = incluster.Checkpointer(local_dir=local_dir, job="p", writer=writer, persistent=root, persistent_every=1,
                                slot_timeout_s=1.0)
    h = ck.save(0, _state(0.0))
    h.wait(30)
    ck.close()
    with pytest.raises(incluster.TierUnavailableError, match="had not finished when close"):
        h.persisted.result(0)
    time.sleep(5.0)  # the slow upload has ended by now
    assert not os.path.isdir(os.path.join(root, "p")) or _manifests(root) == []
    # and it wrote nothing after close() gave up on it (its shard was written before)
    assert not os.path.exists(os.path.join(root, "p", "step-000000000000", "rank-00000.json"))


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))


def test_a_corrupt_newer_step_a_restore_went_back_past_is_not_counted_by_retention(local_dir, tmp_path, caplog):
    """The newest persistent step is corrupt: the restore goes back to the one before.
    Retention used to count that newer step among the steps it keeps and delete the good
    ones (with persistent_keep=1, every good copy). It is kept - the restore may go back
    past a step for a passing reason - but never counted, and named once."""
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(0, 13, 2), persistent_keep=2)
    assert _manifests(root) == ["step-000000000008", "step-000000000012"]
    _flip_last_byte(os.path.join(root, "p", "step-000000000012", "rank-00000.safetensors"))
    shutil.rmtree(os.path.join(local_dir, "p"))
    with caplog.at_level("WARNING", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                    persistent_every=1, persistent_keep=2) as ck:
            assert ck.load(_state(0.0)) == 8
            for step in (9, 10):
                assert ck.save(step, _state(float(step))).persisted.result(60) is True
    assert _manifests(root) == ["step-000000000009", "step-000000000010", "step-000000000012"]
    assert sum("newer than this run's step 9" in r.getMessage() for r in caplog.records) == 1
    shutil.rmtree(os.path.join(local_dir, "p"))
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(target) == 10 and torch.equal(target["w"], torch.full((5000,), 10.0))


def test_a_persistent_step_of_a_timeline_a_restore_went_back_from_is_passed_over(local_dir, tmp_path, caplog):
    """Step 12 was out of sight (a listing that missed it) when a restore went back to 8;
    the run went on with 9 and 10. Back in sight, the old timeline's 12 must not be
    restored over the newer timeline: the manifests record each step's timeline."""
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(0, 13, 2), persistent_keep=3)
    assert _manifests(root) == ["step-000000000004", "step-000000000008", "step-000000000012"]
    hidden = os.path.join(root, "p", "step-000000000012")
    os.rename(hidden, hidden + ".away")
    shutil.rmtree(os.path.join(local_dir, "p"))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1, persistent_keep=3) as ck:
        assert ck.load(_state(0.0)) == 8
        for step in (9, 10):
            assert ck.save(step, _state(100.0 + step)).persisted.result(60) is True
    os.rename(hidden + ".away", hidden)
    shutil.rmtree(os.path.join(local_dir, "p"))
    target = _state(0.0)
    with caplog.at_level("WARNING", logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
            assert ck.load(target) == 10
    assert torch.equal(target["w"], torch.full((5000,), 110.0))
    assert any("persistent step 12 belongs to a timeline a later restore went back from" in r.getMessage()
               for r in caplog.records), caplog.text


def test_a_node_back_with_an_abandoned_step_loses_to_the_later_timeline_in_the_tier(local_dir, tmp_path):
    """The later timeline (back to 8, then 10 and 12 again) survives only in the tier; a
    node comes back with the first timeline's 12 in its RAM. The RAM's copy of 12 won: the
    tier's manifests are evidence of the timelines too."""
    root = str(tmp_path / "persist")

    def ck() -> incluster.Checkpointer:
        return incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                      persistent_every=1, persistent_keep=3)

    with ck() as c:
        for step in (4, 8, 12):
            assert c.save(step, _state(float(step))).persisted.result(60) is True
    away = str(tmp_path / "away")
    shutil.copytree(os.path.join(local_dir, "p"), away)  # the node that goes away, its RAM kept
    hidden = os.path.join(root, "p", "step-000000000012")
    os.rename(hidden, hidden + ".away")
    shutil.rmtree(os.path.join(local_dir, "p"))
    with ck() as c:
        assert c.load(_state(0.0)) == 8
        for step in (10, 12):
            assert c.save(step, _state(1000.0 + step)).persisted.result(60) is True
    shutil.rmtree(hidden + ".away")
    shutil.rmtree(os.path.join(local_dir, "p"))  # the later timeline's RAM is lost; the old node is back
    shutil.copytree(away, os.path.join(local_dir, "p"))
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as c:
        assert c.load(target) == 12
    assert torch.equal(target["w"], torch.full((5000,), 1012.0))


def test_a_step_not_newer_than_the_restored_one_is_refused(local_dir, tmp_path):
    """Restored from the persistent tier alone: save() of an older step is refused, not
    saved beside the newer steps a restore would prefer."""
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(0, 5, 2))
    shutil.rmtree(os.path.join(local_dir, "p"))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(_state(0.0)) == 4
        with pytest.raises(incluster.CheckpointError, match="not newer than step 4, which load.. restored"):
            ck.save(3, _state(3.0))
        ck.save(5, _state(5.0)).wait(30)


def test_an_old_manifest_of_a_step_number_saved_again_never_vouches_for_the_new_shards(local_dir, tmp_path, monkeypatch):
    """After going back past a corrupt step 12, the run saves step 12 again; its upload
    fails after the new shard is written. The old manifest must not stay, naming the old
    checksums beside the new shard: step 12 is simply not in the tier."""
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(0, 13, 2), persistent_keep=3)
    _flip_last_byte(os.path.join(root, "p", "step-000000000012", "rank-00000.safetensors"))
    shutil.rmtree(os.path.join(local_dir, "p"))
    faults = FaultInjector().fail_at(phase="upload", step=12, action="raise")
    monkeypatch.setenv(*next(iter(faults.env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1, persistent_keep=3) as ck:
        assert ck.load(_state(0.0)) == 8
        h = ck.save(12, _state(12.0))
        with pytest.raises(incluster.TierUnavailableError):
            h.persisted.result(60)
    assert _manifests(root) == ["step-000000000004", "step-000000000008"]


def test_a_run_that_never_loaded_does_not_push_the_jobs_older_persistent_steps_out(local_dir, tmp_path, monkeypatch):
    """The same with step numbers above the tier's: the new run's uploads landed, and
    retention silently deleted the steps of the run before. A run's own earlier uploads
    never count as another run's (see the next test)."""
    from incluster import commit

    root = str(tmp_path / "persist")
    _run(local_dir, root, (9, 11, 13), persistent_keep=2)  # every 2nd save: 9 and 13
    shutil.rmtree(os.path.join(local_dir, "p"))
    monkeypatch.setattr(commit, "_run_id", "a-later-launch")  # what a new process draws
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1) as ck:
        h = ck.save(14, _state(14.0))
        with pytest.raises(incluster.TierUnavailableError, match=r"step\(s\) \[9, 13\] of job 'p' from another run, "
                                                                r"and this run did not call load\(\)"):
            h.persisted.result(60)
    assert _manifests(root) == ["step-000000000009", "step-000000000013"]
    shutil.rmtree(os.path.join(local_dir, "p"))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1) as ck:  # after a load(): its timeline goes on
        assert ck.load(_state(0.0)) == 13
        for step in (15, 16, 17):
            assert ck.save(step, _state(float(step))).persisted.result(60)
    assert _manifests(root) == ["step-000000000016", "step-000000000017"]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_checkpointers_one_after_another_in_one_process_are_one_run(local_dir, tmp_path, writer):
    """A training process that makes a new Checkpointer and goes on without load() (as
    Lightning does at every fit()) continues its own steps in the tier, never refused as
    another run's: the run id is the process's."""
    root = str(tmp_path / "persist")
    for steps in ((1, 2), (3, 4), (5,)):
        with incluster.Checkpointer(local_dir=local_dir, job="q", writer=writer, persistent=root,
                                    persistent_every=1) as ck:
            for step in steps:
                assert ck.save(step, _state(float(step))).persisted.result(60)
    assert _manifests(root, "q") == ["step-000000000004", "step-000000000005"]


def test_a_run_that_never_loaded_does_not_overwrite_nor_remove_the_jobs_persistent_steps(local_dir, tmp_path):
    """A new run of a job whose RAM is gone saves without calling load(): the tier's steps
    are another timeline of the job. Its uploads fail naming the fix; nothing is removed
    (retention used to keep the old steps and delete the new run's uploads)."""
    root = str(tmp_path / "persist")
    _run(local_dir, root, range(0, 13, 2), persistent_keep=2)
    shutil.rmtree(os.path.join(local_dir, "p"))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root,
                                persistent_every=1) as ck:
        h = ck.save(0, _state(0.0))
        with pytest.raises(incluster.TierUnavailableError, match=r"did not call load\(\).*Call load\(\) first"):
            h.persisted.result(60)
    assert _manifests(root) == ["step-000000000008", "step-000000000012"]
    target = _state(1.0)
    shutil.rmtree(os.path.join(local_dir, "p"))
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=root) as ck:
        assert ck.load(target) == 12 and torch.equal(target["w"], torch.full((5000,), 12.0))


def _timeline_left_in_ram_and_a_later_one_only_in_the_tier(local_dir, root, aside):
    """Timeline A saves steps 10 and 20 (RAM only); a node away keeps A's step 20; timeline
    B goes back to 10 and saves 15 to the tier; B's RAM copies are lost; the node comes
    back. The only evidence that B went back past 20 is the tier's manifest of step 15."""
    def files(folder, step):
        return [os.path.join(folder, f"step-{step:012d}{ext}") for ext in (".safetensors", ".json")]

    kw = dict(local_dir=local_dir, job="p", writer="thread", persistent=root)
    with incluster.Checkpointer(**kw) as ck:
        ck.save(10, _state(10.0), persist=False).wait()
        ck.save(20, _state(20.0), persist=False).wait()
        folder = ck.folder
    for f in files(folder, 20):
        shutil.move(f, os.path.join(aside, os.path.basename(f)))
    with incluster.Checkpointer(**kw) as ck:
        assert ck.load(_state(0.0)) == 10
        h = ck.save(15, _state(15.0), persist=True)
        h.wait()
        assert h.persisted.result(60) is True
    for f in files(folder, 15):
        os.remove(f)
    for f in files(folder, 20):
        shutil.move(os.path.join(aside, os.path.basename(f)), f)
    return kw


@pytest.mark.parametrize("how", ["bad-copy", "marker-refused", "local-io-error"])
def test_a_tier_step_passed_over_still_tells_which_timeline_was_left(local_dir, tmp_path, monkeypatch, how):
    """Once the tier's step 15 was passed over in a restore (a bad copy; a tier refusing the
    set-aside marker; this node failing to write the download), the next round no longer
    read its manifest: nothing told that A's step 20 was abandoned, and it was loaded."""
    import errno

    import incluster.writer.local_commit as local_commit
    from incluster.tiers.persistent import FsspecTier

    root, aside = str(tmp_path / "persist"), str(tmp_path / "aside")
    os.makedirs(aside)
    kw = _timeline_left_in_ram_and_a_later_one_only_in_the_tier(local_dir, root, aside)
    if how != "local-io-error":
        _flip(root, 15)
    if how == "marker-refused":
        write = FsspecTier.write

        def refuse(self, path, data, **k):
            if path.endswith("SET_ASIDE.json"):
                raise PermissionError(13, "read-only")
            return write(self, path, data, **k)

        monkeypatch.setattr(FsspecTier, "write", refuse)
    if how == "local-io-error":
        def eio(*a, **k):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(local_commit, "commit_received", eio)
    target = _state(0.0)
    with incluster.Checkpointer(**kw) as ck:
        assert ck.load(target) == 10
    assert torch.equal(target["w"], torch.full((5000,), 10.0))


def test_bytes_corrupted_on_one_read_are_read_again_not_set_aside(local_dir, tmp_path, monkeypatch):
    """One bad read (corrupted on its way) must not mark a good step bad for every later
    restore: bytes that do not match are downloaded again once."""
    from incluster.tiers.persistent import FsspecTier

    root = str(tmp_path / "persist")
    _run(local_dir, root, range(6), persistent_keep=2)
    read, flipped = FsspecTier.read, []

    def flip_once(self, path, into=None):
        got = read(self, path, into=into)
        if into is not None and path.endswith(".safetensors") and not flipped:
            flipped.append(path)
            into[len(into) // 2] ^= 1
        return got

    monkeypatch.setattr(FsspecTier, "read", flip_once)
    _restore_from_tier(local_dir, root, 4, 4.0)
    assert flipped and not os.path.exists(os.path.join(root, "p", "step-000000000004", "SET_ASIDE.json"))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_close_uploads_the_newest_step_when_the_newest_due_upload_was_skipped(local_dir, tmp_path, writer):
    """Saves quicker than the first upload (an object store's client starting): every due
    step meanwhile was skipped, and the run ended with the tier at its first step."""
    from incluster.testing import SlowTier
    from incluster.tiers.persistent import FsspecTier

    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer=writer, persistent=SlowTier(FsspecTier(root),
                                latency_s=0.4), persistent_every=2) as ck:
        started = getattr(ck._writer, "started", None)
        if started is not None:  # saves faster than the writer's start would give up their slots
            started.result(60)
        handles = [ck.save(step, _state(float(step))) for step in range(6)]  # due: 0, 2, 4
        for h in handles:
            h.wait()
        assert handles[4].persisted.result(30) is False  # skipped: step 0 still uploading
    assert _manifests(root) == ["step-000000000000", "step-000000000005"]
    _restore_from_tier(local_dir, root, 5, 5.0)


@pytest.mark.parametrize("writer", ["thread", "process", "thread-late-skip-word"])
def test_close_catches_up_after_a_skipped_due_upload_with_persistent_interval_s(local_dir, tmp_path, writer,
                                                                                monkeypatch):
    """With persistent_interval_s every save waits for its decision: a due save skipped for
    the running upload, then one inside the interval ("not due"). close() looked at that
    last one only, and the run ended with the tier at its first step. The skip's word may
    come after the newer save's (it is published first): close() right away still sees it."""
    from incluster.persist import Uploader
    from incluster.testing import SlowTier
    from incluster.tiers.persistent import FsspecTier

    late = writer == "thread-late-skip-word"
    if late:
        publish = Uploader._publish_failure

        def slow_publish(self, *args):
            time.sleep(0.5)
            return publish(self, *args)

        monkeypatch.setattr(Uploader, "_publish_failure", slow_publish)
        writer = "thread"
    root = str(tmp_path / "persist")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer=writer, persistent_interval_s=0.5,
                                persistent=SlowTier(FsspecTier(root), bytes_per_s=15e3)) as ck:  # ~1.3 s a shard
        first = ck.save(0, _state(0.0))
        first.wait()
        time.sleep(0.7)
        skipped = ck.save(1, _state(1.0))  # due, while step 0 still uploads
        last = ck.save(2, _state(2.0))  # right after: inside the interval
        for h in (skipped, last):
            h.wait()
        if not late:
            assert skipped.persisted.result(30) is False and "still running" in skipped.skip_word
            assert last.persisted.result(30) is False and "not due" in last.skip_word
    assert skipped.persisted.result(0) is False and last.persisted.result(0) is False
    assert _manifests(root) == ["step-000000000000", "step-000000000002"]
    _restore_from_tier(local_dir, root, 2, 2.0)


def test_persist_last_uploads_the_newest_step_at_close_whatever_the_schedule(local_dir, tmp_path):
    root = str(tmp_path / "persist")
    for job, last in (("plain", False), ("last", True)):
        with incluster.Checkpointer(local_dir=local_dir, job=job, writer="thread", persistent=root,
                                    persistent_every=100) as ck:
            ck.persist_last = last
            for step in range(4):  # only the run's first save is due
                ck.save(step, _state(float(step))).wait()
        assert _manifests(root, job) == (["step-000000000000", "step-000000000003"] if last else ["step-000000000000"])


def test_a_writer_process_logs_at_the_trainers_level(local_dir, tmp_path):
    """The writer process says later skips at INFO; a trainer logging INFO never saw them."""
    import subprocess
    import sys

    script = f"""
import logging, torch, incluster
from incluster.testing import SlowTier
from incluster.tiers.persistent import FsspecTier
logging.basicConfig(level=logging.INFO)
with incluster.Checkpointer(local_dir={local_dir!r}, job="p", writer="process", persistent_every=1,
                            persistent=SlowTier(FsspecTier({str(tmp_path / "persist")!r}), latency_s=0.5)) as ck:
    for step in range(4):
        ck.save(step, {{"w": torch.full((1000,), float(step))}}).wait()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped so far" in proc.stderr and "(writer process)" in proc.stderr, proc.stderr[-3000:]


class _ScriptedTier:
    """The local tier; shard writes sleep as scripted (one entry per write), or every
    write is refused (``down``)."""

    def __init__(self, root, sleeps=(), down=False):
        from incluster.tiers.persistent import FsspecTier

        self.inner, self.sleeps, self.down, self.writes = FsspecTier(root), list(sleeps), down, []
        self.posix, self.url = True, root

    def write(self, path, data, *, atomic=True):
        self.writes.append(path)
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        if path.endswith(".safetensors") and self.sleeps:
            time.sleep(self.sleeps.pop(0))
        return self.inner.write(path, data, atomic=atomic)

    def read(self, path, into=None):
        return self.inner.read(path, into)

    def delete(self, path):
        return self.inner.delete(path)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def close(self):
        self.inner.close()


def test_close_never_uploads_again_a_step_whose_upload_had_no_word_yet(local_dir, tmp_path):
    """The newest step's own upload ended just after close() stopped waiting for its word:
    a second upload of it (persist_last) removed the manifest the first had just written,
    and close() cut it short - the tier lost its newest step."""
    root = str(tmp_path / "persist")
    ck = incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=_ScriptedTier(root, [4.0]),
                                persistent_every=1, slot_timeout_s=6.0)  # the word comes after close()'s 3 s
    ck.persist_last = True
    assert ck.load(_state(0.0)) is None  # resume-or-start, as the integrations do
    h = ck.save(0, _state(0.0))
    h.wait()
    ck.close()
    assert h.persisted.result(10) is True and _manifests(root) == ["step-000000000000"]


def test_close_with_a_hung_upload_waits_about_slot_timeout_s_not_twice(local_dir, tmp_path):
    ck = incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent_every=1, slot_timeout_s=4.0,
                                persistent=_ScriptedTier(str(tmp_path / "persist"), [30.0]))
    ck.save(0, _state(0.0)).wait()
    t0 = time.monotonic()
    ck.close()
    assert time.monotonic() - t0 < 6.0


def test_close_adds_no_upload_to_a_failing_tier_nor_for_steps_interval_mode_did_not_want(local_dir, tmp_path):
    down = _ScriptedTier(str(tmp_path / "down"), down=True)
    ck = incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=down, persistent_every=1,
                                slot_timeout_s=30)
    ck.persist_last = True
    h = ck.save(0, _state(0.0))
    h.wait()
    with pytest.raises(incluster.TierUnavailableError):
        h.persisted.result(30)
    tried = len(down.writes)
    ck.close()
    assert len(down.writes) == tried
    root = str(tmp_path / "persist")  # persistent_interval_s: "not due" is no skip to catch up
    with incluster.Checkpointer(local_dir=local_dir, job="q", writer="thread", persistent=root,
                                persistent_interval_s=3600) as ck:
        for step in range(4):
            ck.save(step, _state(float(step))).wait()
    assert _manifests(root, "q") == ["step-000000000000"]
