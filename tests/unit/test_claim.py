"""One live Checkpointer per job, rank and RAM folder: a second run with the same job
name is refused (it used to resume the first run's step and then overwrite its slots),
while a SIGKILLed run never blocks its restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import incluster

HOLD = """
import sys, time, incluster
ck = incluster.Checkpointer(local_dir=sys.argv[1], job="same", writer="thread")
ck.save(1, {"w": __import__("torch").ones(4)}).wait()
print("ready", flush=True)
time.sleep(120)
"""


def test_a_second_run_with_the_same_job_name_is_refused_until_the_first_is_gone(local_dir):
    first = subprocess.Popen([sys.executable, "-c", HOLD, local_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
        with pytest.raises(incluster.CheckpointError, match=rf"job 'same' rank 0 is in use .* by process {first.pid} "
                                                            r".*give this run its own job="):
            incluster.Checkpointer(local_dir=local_dir, job="same", writer="thread")
        with incluster.Checkpointer(local_dir=local_dir, job="other", writer="thread") as ck:  # another name: fine
            ck.save(1, {"w": torch.ones(4)}).wait()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    target = {"w": torch.zeros(4)}
    with incluster.Checkpointer(local_dir=local_dir, job="same", writer="thread") as ck:  # the killed run's claim is gone
        assert ck.load(target) == 1 and torch.equal(target["w"], torch.ones(4))


def test_a_second_checkpointer_of_one_job_in_one_process_closes_the_first(local_dir, caplog):
    """Re-running a notebook cell makes a new Checkpointer while the last is still open
    (and may be out of reach): two would write the same files, so the first is closed,
    its save drained, and said so."""
    first = incluster.Checkpointer(local_dir=local_dir, job="same", writer="thread")
    first.save(1, {"w": torch.ones(4)})
    with caplog.at_level("WARNING", logger="incluster"):
        second = incluster.Checkpointer(local_dir=local_dir, job="same", writer="thread")
    assert any("the earlier one, still open, is closed first" in r.getMessage() for r in caplog.records)
    with pytest.raises(incluster.CheckpointError, match="closed"):
        first.save(2, {"w": torch.ones(4)})
    target = {"w": torch.zeros(4)}
    assert second.load(target) == 1 and torch.equal(target["w"], torch.ones(4))  # the drained save landed
    second.close()


def test_a_process_forked_while_the_claim_was_held_does_not_keep_it(local_dir):
    """Data-loader workers fork from the trainer; one still alive must not block the next
    Checkpointer of the same job after close()."""
    ck = incluster.Checkpointer(local_dir=local_dir, job="same", writer="thread")
    pid = os.fork()
    if pid == 0:  # the "worker": outlives the close below
        time.sleep(5)
        os._exit(0)
    try:
        ck.close()
        incluster.Checkpointer(local_dir=local_dir, job="same", writer="thread").close()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_checkpointer_that_failed_to_start_leaves_its_claim_free(local_dir, writer):
    """A user who fixes a bad option and tries again was told the job was in use by a
    Checkpointer of this process - one they never got to close."""
    with pytest.raises(Exception):
        incluster.Checkpointer(local_dir=local_dir, job="same", writer=writer, run_dir="/proc/nope/x")
    with incluster.Checkpointer(local_dir=local_dir, job="same", writer=writer) as ck:
        ck.save(1, {"w": torch.ones(4)}).wait()


def test_a_job_folder_this_process_cannot_write_is_named_with_the_fix(local_dir, monkeypatch):
    """It exists (another user made it, or a read-only mount): not a raw OSError. (The
    refusal is injected: this suite may run as root, whom no mode bit refuses.)"""
    import errno

    from incluster import claim

    real = claim.os.open

    def refuse(path, *a, **k):
        if os.path.basename(path).startswith(".claim-"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, *a, **k)

    monkeypatch.setattr(claim.os, "open", refuse)
    with pytest.raises(incluster.CheckpointError, match="cannot write this job's folder.*Permission denied.*point local_dir"):
        incluster.Checkpointer(local_dir=local_dir, job="ro", writer="thread")


def test_two_node_names_of_one_run_in_one_ram_folder_are_refused_naming_both(local_dir):
    """A local_dir on a shared filesystem (or two simulated nodes given one): each node took
    the other's files for copies; commits failed with vanished files, and a fit hung."""
    from incluster.claim import refuse_shared_folder

    folder = os.path.join(local_dir, "job")
    os.makedirs(folder)
    refuse_shared_folder(folder, 0, "nA", "run-1")
    refuse_shared_folder(folder, 1, "nA", "run-1")  # two ranks of one node: its folder
    refuse_shared_folder(folder, 2, "nB", "run-0")  # an earlier run's record is no evidence...
    refuse_shared_folder(folder, 2, "nA", "run-1")  # ... and is overwritten by this run's
    with pytest.raises(incluster.CheckpointError, match=r"written by node 'nA' \(rank [012]\) and by node 'nB' \(rank 3\)"):
        refuse_shared_folder(folder, 3, "nB", "run-1")
