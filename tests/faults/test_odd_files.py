"""Things that are not checkpoint files where checkpoint files are looked for: a named
pipe (whose open blocks until a writer comes), a folder, a manifest with an absurd world
size. Each is refused as damaged, said with its path, and an older step is used; nothing
hangs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import incluster

JOB = "odd"


def _state(v: float) -> dict:
    return {"w": torch.full((4096,), v)}


def _saved(local_dir: str, root: str | None = None) -> None:
    with incluster.Checkpointer(local_dir=local_dir, job=JOB, writer="thread", persistent=root,
                                persistent_every=1) as ck:
        for step in (1, 2):
            h = ck.save(step, _state(float(step)))
            h.wait()
            if root:
                assert h.persisted.result(60) is True


def _tier_only(local_dir: str, tmp_path) -> str:
    """Steps 1 and 2 saved and uploaded, then the RAM gone: the tier alone holds them."""
    root = str(tmp_path / "tier")
    _saved(local_dir, root)
    shutil.rmtree(os.path.join(local_dir, JOB))
    return root


def _restores_step_1(local_dir: str, root: str | None = None) -> None:
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job=JOB, writer="thread", persistent=root) as ck:
        assert ck.load(target) == 1 and torch.equal(target["w"], torch.full((4096,), 1.0))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "incluster", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_ls_verify_and_load_refuse_a_named_pipe_or_folder_as_a_commit_record(local_dir, kind):
    _saved(local_dir)
    sidecar = os.path.join(local_dir, JOB, "rank-00000", "step-000000000002.json")
    os.unlink(sidecar)
    os.mkfifo(sidecar) if kind == "fifo" else os.mkdir(sidecar)
    for cmd in ("ls", "verify"):
        res = _cli(cmd, local_dir)
        said = res.stdout + res.stderr
        assert "Errno" not in said and "step-000000000002.json" in said, (cmd, said)
        assert ("named pipe" if kind == "fifo" else "a folder") in said, (cmd, said)
    _restores_step_1(local_dir)


def test_verify_refuses_a_named_pipe_as_a_shard(local_dir):
    _saved(local_dir)
    shard = os.path.join(local_dir, JOB, "rank-00000", "step-000000000002.safetensors")
    os.unlink(shard)
    os.mkfifo(shard)
    res = _cli("verify", local_dir)
    assert res.returncode == 1 and "named pipe" in res.stdout + res.stderr, res.stdout + res.stderr


def test_a_named_pipe_in_the_persistent_tier_is_passed_over_for_an_older_step(local_dir, tmp_path):
    root = _tier_only(local_dir, tmp_path)
    shard = os.path.join(root, JOB, "step-000000000002", "rank-00000.safetensors")
    os.unlink(shard)
    os.mkfifo(shard)
    _restores_step_1(local_dir, root)


def test_a_manifest_with_an_absurd_world_size_is_skipped_not_a_memory_error(local_dir, tmp_path):
    root = _tier_only(local_dir, tmp_path)
    path = os.path.join(root, JOB, "step-000000000002", "COMMITTED.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["world_size"] = 10**14
    with open(path, "w") as f:
        json.dump(manifest, f)
    _restores_step_1(local_dir, root)


def test_a_folder_where_a_tier_manifest_is_looked_for_is_skipped_for_an_older_step(local_dir, tmp_path):
    root = _tier_only(local_dir, tmp_path)
    path = os.path.join(root, JOB, "step-000000000002", "COMMITTED.json")
    os.unlink(path)
    os.mkdir(path)
    _restores_step_1(local_dir, root)
