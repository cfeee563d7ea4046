"""A persistent tier that refuses or stops answering: what the user is told, and how soon."""

from __future__ import annotations

import errno
import logging
import time

import pytest
import torch

import incluster
from incluster.testing.tiers import FaultyTier
from incluster.tiers.persistent import FsspecTier


def _state(v: float) -> dict:
    return {"w": torch.full((5000,), v)}


def test_refused_credentials_fail_at_once_and_name_what_to_check(local_dir, tmp_path):
    """A permission error cannot pass on a retry: one attempt, and the fix is named."""
    tier = FaultyTier(FsspecTier(str(tmp_path / "persist")), ops=("write",), errno_=errno.EACCES, posix=False)
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=tier,
                                persistent_every=1) as ck:
        h = ck.save(0, _state(0.0))
        with pytest.raises(incluster.TierUnavailableError, match="refused these credentials.*persistent_options"):
            h.persisted.result(30)
    assert tier.calls == 1


def test_a_folder_this_process_cannot_write_is_named_not_credentials(local_dir, tmp_path, caplog):
    """A plain path has no keys or bucket policy to check; the same failure again is
    not warned of again."""
    folder = str(tmp_path / "persist")
    tier = FaultyTier(FsspecTier(folder), ops=("write",), errno_=errno.EACCES)
    caplog.set_level(logging.INFO, logger="incluster")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=tier,
                                persistent_every=1) as ck:
        for step in (0, 1):
            h = ck.save(step, _state(float(step)))
            with pytest.raises(incluster.TierUnavailableError) as err:
                h.persisted.result(30)
            assert f"may write to the persistent folder {folder}" in str(err.value), err.value
            assert "credentials" not in str(err.value) and "fail:" not in str(err.value), err.value
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "persistent save of step" in r.message]
    assert len(warned) == 1, [r.message for r in warned]


def test_a_persistent_path_that_cannot_be_made_is_refused_when_the_checkpointer_starts(local_dir, tmp_path):
    """It was found only at the first upload, as a warning, while training went on."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for bad in (str(blocker / "run"), "/proc/1/nope/run"):
        with pytest.raises(incluster.TierUnavailableError, match=r"cannot be written.*fix persistent="):
            incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=bad)
    made = tmp_path / "x" / "y" / "z"
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=str(made)):
        assert made.is_dir()  # a nested path that does not exist yet is made


def test_a_filesystem_in_process_memory_is_refused_with_the_process_writer(local_dir):
    """memory:// with the default writer process: every upload went into the writer's own
    memory and was lost with it, while ``persisted`` said True. With writer='thread' the
    uploads run in this process and a fresh Checkpointer restores from them."""
    url = f"memory://incluster-mem-{time.monotonic_ns()}"
    with pytest.raises(ValueError, match="writer='thread'"):
        incluster.Checkpointer(local_dir=local_dir, job="m", persistent=url)
    from incluster.config import resolve
    from incluster.testing import SlowTier
    from incluster.wiring import persist_params

    with pytest.raises(ValueError, match="writer process uploads"):  # wrapped, as a test rehearses a slow tier
        persist_params(resolve(local_dir=local_dir, job="m", persistent=SlowTier(FsspecTier(url))), 0, 1, "r")
    with pytest.raises(ValueError, match="each of the 2 ranks is a process of its own"):
        persist_params(resolve(local_dir=local_dir, job="m", persistent=url, writer="thread"), 0, 2, "r")
    with incluster.Checkpointer(local_dir=local_dir, job="m", persistent=url, persistent_every=1,
                                writer="thread") as ck:
        assert ck.save(1, _state(1.0)).persisted.result(30) is True
    import shutil

    shutil.rmtree(local_dir)
    state = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="m", persistent=url, writer="thread") as ck:
        assert ck.load(state) == 1 and ck.last_restore.source == "persistent"
    assert torch.equal(state["w"], _state(1.0)["w"])


def test_store_verdicts_and_local_permission_hints_read_as_words():
    from incluster.persist import _words, fix_for

    assert _words("fail:0:PermissionError: [Errno 13] x") == "rank 0: PermissionError: [Errno 13] x"
    assert _words("fail:1:step 9 failed on rank 1") == "rank 1: step 9 failed on rank 1"
    assert _words("fail:?:no outcome within 5 s") == "no outcome within 5 s"
    from incluster.persist import _skipped_elsewhere

    assert _skipped_elsewhere("fail:1:skipped, previous upload still running") == (
        "skipped: rank 1 skipped, previous upload still running")  # a skip (persisted False), not a failure
    assert _skipped_elsewhere("fail:1:PermissionError") is None and _skipped_elsewhere(None) is None
    assert "owner and mode" in fix_for("PermissionError: [Errno 13]", "/mnt/ckpt")
    assert "credentials" in fix_for("PermissionError: [Errno 13]", None)  # an object store


def test_a_skip_while_the_upload_retries_says_the_tier_is_failing_not_slow(local_dir, tmp_path, caplog):
    """The advice for uploads that are merely slow (raise persistent_every) is wrong when
    the running upload is retrying after errors: the warning says what failed instead."""
    tier = FaultyTier(FsspecTier(str(tmp_path / "persist")), ops=("write",), times=2)
    with caplog.at_level(logging.INFO, logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=tier,
                                    persistent_every=1) as ck:
            first = ck.save(0, _state(0.0))
            first.wait(30)
            deadline = time.monotonic() + 10
            while not tier.failures and time.monotonic() < deadline:  # then the upload waits to retry
                time.sleep(0.01)
            second = ck.save(1, _state(1.0))
            assert second.persisted.result(30) is False
            assert first.persisted.result(30) is True  # the third attempt got through
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "skips" in r.getMessage()]
    assert len(warned) == 1 and "still retrying after an error" in warned[0], warned
    assert "the tier did not answer" in warned[0] and "raise persistent_every" not in warned[0]


def test_an_endpoint_that_refuses_connections_is_named_as_such_and_tried_once(local_dir):
    """Not taken for a missing bucket; one attempt through the client's own retries (the
    client's policy - here one attempt - rules, not a second loop of retries around it)."""
    from incluster.testing.launch import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": dead, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent="s3://bkt/run",
                                persistent_options=opts, persistent_every=1) as ck:
        h = ck.save(0, _state(0.0))
        t0 = time.monotonic()
        with pytest.raises(incluster.TierUnavailableError, match="the tier did not answer") as err:
            h.persisted.result(60)
        assert time.monotonic() - t0 < 15
    assert "does not exist" not in str(err.value)


def test_close_failing_to_upload_the_newest_step_says_so_at_warning(local_dir, tmp_path, caplog):
    """The tier fails every write after step 0's upload (the job's owner record, shard,
    sidecar, manifest). Step 1's failure is warned of;
    step 2 is skipped (step 1's upload still runs), so close() uploads it, and that fails
    the same way: it was logged at INFO as a repeat, and with default logging nobody
    learned that the run's last state never reached the tier."""
    from incluster.testing import SlowTier

    tier = SlowTier(FaultyTier(FsspecTier(str(tmp_path / "persist")), ops=("write",), after=4), latency_s=0.3)
    caplog.set_level(logging.INFO, logger="incluster")
    with incluster.Checkpointer(local_dir=local_dir, job="p", writer="thread", persistent=tier,
                                persistent_every=1) as ck:
        assert ck.save(0, _state(0.0)).persisted.result(30) is True
        one = ck.save(1, _state(1.0))
        one.wait()
        two = ck.save(2, _state(2.0))
        two.wait()
        assert two.persisted.result(30) is False  # skipped: step 1's upload was still retrying
        with pytest.raises(incluster.TierUnavailableError):
            one.persisted.result(30)
    said = [r for r in caplog.records if "close() could not upload step 2" in r.getMessage()]
    assert said and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
