"""A full RAM disk: the save fails with an error that names the fix, training goes on,
nothing committed is lost. On a real, small tmpfs when this machine lets a test mount one
(a private mount namespace), else with ENOSPC injected at the allocation call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from incluster.testing import FaultInjector

SCRIPT = os.path.join(os.path.dirname(__file__), "ram_disk_full_script.py")


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["fill", "inject"])
def test_ram_disk_full(local_dir, tmp_path, mode):
    result = tmp_path / "result.json"
    folder = os.path.join(local_dir, "ram")
    os.makedirs(folder)
    if mode == "fill":
        if not _can_mount_tmpfs():
            pytest.skip("this machine does not let a test mount a small tmpfs; the 'inject' case stands in")
        cmd = ["unshare", "-rm", "sh", "-c",
               f'mount -t tmpfs -o size=4m,mode=0700 tmpfs "$1" && exec "$2" "$3" "$1" "$4" fill',
               "sh", folder, sys.executable, SCRIPT, str(result)]
        env = dict(os.environ)
    else:
        cmd = [sys.executable, SCRIPT, folder, str(result), "inject"]
        env = {**os.environ, **FaultInjector().fail_at(phase="allocate", step=2, action="enospc").env()}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(result.read_text())
    if mode == "fill":
        assert out["filled"] == 28  # ENOSPC: the disk really was full
    kind, msg = out["step2"]
    assert kind in ("CheckpointError", "CommitError") and "No space left on device" in msg and "free space" in msg, msg
    assert out["loaded"] == 1 and out["bitwise"] is True
    # still full in "fill": a save that fits its slot lands all the same (its commit record
    # uses the space held in reserve, reserve.py); the reserve is back once space is free
    assert out["step3"] == "durable", out["step3"]
    assert out["step4"] == "durable", out["step4"]
    assert out["reserve_back"] is True


def _small_ram_disk(local_dir: str, tmp_path, size: str, *mode: str) -> tuple[subprocess.CompletedProcess, dict]:
    """small_ram_disk_script.py on a private tmpfs of ``size``: (the process, its result)."""
    if not _can_mount_tmpfs():
        pytest.skip("this machine does not let a test mount a small tmpfs")
    result = tmp_path / "result.json"
    folder = os.path.join(local_dir, "ram")
    os.makedirs(folder)
    script = os.path.join(os.path.dirname(__file__), "small_ram_disk_script.py")
    cmd = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$1" && exec "$2" "$3" "$1" "$4" ${{5:+"$5"}}',
           "sh", folder, sys.executable, script, str(result), *mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(result.read_text())


@pytest.mark.multiproc
def test_a_ram_disk_with_room_for_fewer_slots_than_keep_keeps_fewer_steps_and_saves_go_on(local_dir, tmp_path):
    """keep=4 of a 1 MiB shard on a RAM disk with room for two slots: said up front, then
    once that two are kept; every save lands (each reuses the older slot). The empty slots
    that got no room were taken first before, and every save after the second failed."""
    proc, out = _small_ram_disk(local_dir, tmp_path, "3584k")
    assert out["saves"] == {str(s): "durable" for s in range(1, 7)}, out["saves"]
    assert out["slots"] == 2 and out["loaded"] == 6 and out["bitwise"] is True, out
    assert "fewer steps than keep=4 will be kept" in proc.stderr, proc.stderr
    assert proc.stderr.count("keeping 2 from now on") == 2, proc.stderr  # once per Checkpointer (two here)


@pytest.mark.multiproc
def test_the_slots_left_out_for_want_of_room_come_back_once_there_is_room(local_dir, tmp_path):
    """A RAM disk that was full for a while (another job's files, a burst of replicas)
    must not cost the rest of the run its older steps: once the room is back, the ring
    grows to keep=4 again, in the background, and keeps four steps."""
    proc, out = _small_ram_disk(local_dir, tmp_path, "8m", "regrow")
    assert out["saves"] == {str(s): "durable" for s in range(1, 11)}, out["saves"]
    assert out["slots_after"]["4"] == 2, out  # shrunk while the filler held the room
    assert out["slots"] == 4 and out["held"] == [7, 8, 9, 10], out  # four steps kept again
    assert out["loaded"] == 10 and out["bitwise"] is True, out
    assert proc.stderr.count("keeping 2 from now on") == 1, proc.stderr
    assert "has room again for a checkpoint slot; keeping 4 of the 4" in proc.stderr, proc.stderr


@pytest.mark.multiproc
def test_a_ram_disk_with_room_for_one_slot_says_saves_need_two(local_dir, tmp_path):
    """Room for one slot only: no save can land beside the newest step. Said up front, and
    each failed save names the room needed - never "lower keep", which cannot go below 2."""
    proc, out = _small_ram_disk(local_dir, tmp_path, "2304k")
    assert out["saves"]["1"] == "durable", out["saves"]
    for step in range(2, 7):
        kind, msg = out["saves"][str(step)]
        assert "at least 2 slots of 1.0 MiB" in msg and "lower keep" not in msg, msg
    assert "saves will fail until" in proc.stderr, proc.stderr
    assert out["loaded"] == 1, out


@pytest.mark.multiproc
def test_room_a_few_kib_short_of_two_slots_is_never_said_as_0_mib(local_dir, tmp_path):
    """Two 1 MiB slots on a RAM disk with 2 MiB free beside the reserve: short by their
    headers' bytes. The warning said "only 2.0 MiB are free ... until 0.0 MiB more are free"."""
    proc, out = _small_ram_disk(local_dir, tmp_path, "3072k")
    assert out["saves"]["1"] == "durable", out["saves"]
    said = " ".join(proc.stderr.split())
    assert "saves will fail until 0.1 MiB more are free" in said and "0.0 MiB" not in said, proc.stderr
    assert "only 1.9 MiB are free" in said, proc.stderr
