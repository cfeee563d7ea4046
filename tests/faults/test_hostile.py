"""Hostile checkpoint files: each is refused with a clear error, nothing outside the
checkpoint folder is read or written, and no code runs. A good older step is used when
there is one; otherwise the error names what is wrong.

Every case starts from a real checkpoint (steps 1 and 2), damages step 2 the way an
attacker or a broken disk would, keeping the checksums consistent where that matters (so
the strict reader, not the checksum, must catch it), and restores.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct

import pytest
import torch

import incluster
from incluster.format.checksum import compute
from incluster.format.sidecar import record_digest
from incluster.writer.local_commit import parse_received_sidecar

JOB = "h"


def _state(v: float) -> dict:
    return {"w": torch.full((64, 64), v), "b": torch.arange(10, dtype=torch.int64) * int(v), "extra": {"v": v}}


def _save(local_dir: str, steps=(1, 2), **kw) -> None:
    with incluster.Checkpointer(local_dir=local_dir, job=JOB, writer="thread", **kw) as ck:
        for s in steps:
            h = ck.save(s, _state(float(s)))
            h.wait()
            if "persistent" in kw:
                assert h.persisted.result(60) is True


def _folder(local_dir: str) -> str:
    return os.path.join(local_dir, JOB, "rank-00000")


def _paths(local_dir: str, step: int) -> tuple[str, str]:
    f = _folder(local_dir)
    return os.path.join(f, f"step-{step:012d}.safetensors"), os.path.join(f, f"step-{step:012d}.json")


def _load(local_dir: str, **kw) -> tuple[int | None, dict]:
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job=JOB, writer="thread", **kw) as ck:
        return ck.load(target), target


def _restores_step_1(local_dir: str, caplog, why: str) -> None:
    step, target = _load(local_dir)
    assert step == 1
    assert torch.equal(target["w"], _state(1.0)["w"]) and target["extra"] == {"v": 1.0}
    assert why in caplog.text, caplog.text[-2000:]


def _seal(obj):
    """Re-seal a tampered record the way anyone can (the digest is a checksum, not a
    signature), so the checks behind it are what refuses it."""
    if isinstance(obj, dict):
        obj.pop("digest", None)
        try:
            obj["digest"] = record_digest(obj)
        except (TypeError, ValueError, RecursionError):
            pass  # too deep or odd to serialize: the loader's own bounds refuse it
    return obj


def _edit_sidecar(local_dir: str, step: int, change) -> None:
    _, sc = _paths(local_dir, step)
    obj = json.load(open(sc))
    change(obj)
    with open(sc, "w") as f:
        json.dump(_seal(obj), f)


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda o: o.update(shard="../../../../etc/passwd"), "outside its folder"),
        (lambda o: o.update(shard="/etc/passwd"), "outside its folder"),
        (lambda o: o.update(shard="step-000000000001.safetensors"), "checksum mismatch"),  # another step's bytes
        (lambda o: o.update(step=7), "says step 7"),
        (lambda o: o.update(rank=3), "invalid step/rank/world_size"),
        (lambda o: o.update(world_size=-1), "invalid step/rank/world_size"),
        (lambda o: o["checksum"].update(size=-5), "checksum record has bad fields"),
        (lambda o: o["checksum"].update(digests=["0" * 16]), "checksum mismatch"),
        (lambda o: o.update(version=99), "upgrade incluster"),
        (lambda o: o.pop("tree"), "lacks field"),
    ],
)
def test_tampered_sidecar_is_refused_and_the_older_step_used(local_dir, caplog, change, why):
    _save(local_dir)
    _edit_sidecar(local_dir, 2, change)
    _restores_step_1(local_dir, caplog, why)


def test_unparseable_sidecars_are_refused(local_dir, caplog):
    _save(local_dir)
    _, sc = _paths(local_dir, 2)
    with open(sc, "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)  # a nesting bomb: valid JSON, deeper than any parser's stack
    _restores_step_1(local_dir, caplog, "not valid JSON")


def test_a_sidecar_deeper_than_the_loader_allows_is_refused(local_dir, caplog):
    _save(local_dir)

    def deep(o):
        node: dict = {"v": 1}
        for _ in range(250):  # within what JSON parses, beyond what the loader walks
            node = {"d": [["k", node]]}
        o["tree"] = node

    _edit_sidecar(local_dir, 2, deep)
    for step in (1,):  # the older step is gone too: only the hostile one is left
        for p in _paths(local_dir, step):
            os.unlink(p)
    with pytest.raises(incluster.NoCheckpointError, match=r"copies of step\(s\) \[2\] failed verification") as got:
        _load(local_dir)  # never a silent fresh start while a (bad) checkpoint exists
    assert "name a new job" in str(got.value) and "delete" not in str(got.value)  # never advice that destroys copies
    assert "nested deeper" in caplog.text


def _rewrite_shard(local_dir: str, step: int, header: dict, payload: bytes) -> None:
    """Write a shard with this header and payload and a sidecar whose checksum matches."""
    shard, sc = _paths(local_dir, step)
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 64)
    data = struct.pack("<Q", len(raw)) + raw + payload
    with open(shard, "wb") as f:
        f.write(data)
    obj = json.load(open(sc))
    obj["checksum"] = compute(data).to_json()
    json.dump(_seal(obj), open(sc, "w"))


@pytest.mark.parametrize(
    "header, why",
    [
        ({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 16384]},
          "b": {"dtype": "I64", "shape": [10], "data_offsets": [16000, 16080]}}, "overlapping"),
        ({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 16384]},
          "b": {"dtype": "I64", "shape": [-10], "data_offsets": [16384, 16304]}}, ""),  # negative size
        ({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 16384]},
          "b": {"dtype": "X99", "shape": [10], "data_offsets": [16384, 16464]}}, "dtype"),
        ({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16384]},
          "b": {"dtype": "I64", "shape": [10], "data_offsets": [16384, 16464]}}, ""),  # shape x dtype != span
    ],
)
def test_malformed_shard_with_a_matching_checksum_is_refused(local_dir, caplog, header, why):
    _save(local_dir)
    _rewrite_shard(local_dir, 2, header, bytes(16464))
    _restores_step_1(local_dir, caplog, why)


def test_huge_header_length_is_refused_without_reading_it(local_dir, caplog):
    _save(local_dir)
    shard, sc = _paths(local_dir, 2)
    data = struct.pack("<Q", 2**62) + bytes(100)
    open(shard, "wb").write(data)
    obj = json.load(open(sc))
    obj["checksum"] = compute(data).to_json()
    json.dump(_seal(obj), open(sc, "w"))
    _restores_step_1(local_dir, caplog, "header")


def test_pickle_payload_never_runs_without_allow_pickle(local_dir, tmp_path, caplog):
    """A sidecar can point a leaf at pickled bytes; loading must refuse, not unpickle."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Evil())
    _save(local_dir)
    shard, sc = _paths(local_dir, 2)
    header = {"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}
    _rewrite_shard(local_dir, 2, header, payload)
    _edit_sidecar(local_dir, 2, lambda o: o.update(tree={"d": [[k, {"P": "w"}] for k in ("w", "b", "extra")]}))
    for p in _paths(local_dir, 1):
        os.unlink(p)
    with pytest.raises(incluster.CheckpointError, match="allow_pickle"):
        _load(local_dir)
    assert not marker.exists()


@pytest.mark.parametrize("which", ["shard", "sidecar"])
def test_symlinks_in_the_checkpoint_folder_are_never_followed(local_dir, tmp_path, caplog, which):
    _save(local_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    shard, sc = _paths(local_dir, 2)
    victim = str(outside / os.path.basename(shard if which == "shard" else sc))
    path = shard if which == "shard" else sc
    shutil.move(path, victim)
    os.symlink(victim, path)
    before = open(victim, "rb").read()
    _restores_step_1(local_dir, caplog, "never followed")
    with incluster.Checkpointer(local_dir=local_dir, job=JOB, writer="thread") as ck:  # saves reuse slots
        for s in (3, 4, 5):
            ck.save(s, _state(float(s))).wait()
    assert open(victim, "rb").read() == before  # never written through the link


def test_a_symlinked_rank_folder_is_refused(local_dir, tmp_path):
    _save(local_dir)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(_folder(local_dir), elsewhere)
    os.symlink(elsewhere, _folder(local_dir))
    with pytest.raises(incluster.CheckpointError, match="symbolic link"):
        incluster.Checkpointer(local_dir=local_dir, job=JOB, writer="thread")


@pytest.mark.parametrize(
    "received, why",
    [
        (lambda o: o.update(rank=1), "invalid step/rank/world_size"),
        (lambda o: o.update(rank=1, world_size=2), "describes rank 1"),
        (lambda o: o.update(step=9), "step 9"),
        (lambda o: o.update(job="other"), "job 'other'"),
        (lambda o: o.update(shard="../../x"), "outside its folder"),
        (lambda o: o["checksum"].update(size=1), "bytes"),
    ],
)
def test_a_peers_sidecar_is_checked_against_what_was_asked_for(local_dir, received, why):
    _save(local_dir)
    _, sc = _paths(local_dir, 2)
    obj = json.load(open(sc))
    size = obj["checksum"]["size"]
    received(obj)
    with pytest.raises(incluster.CorruptCheckpointError, match=why):
        parse_received_sidecar(json.dumps(_seal(obj)).encode(), "peer", rank=0, step=2, job=JOB, size=size)
    with pytest.raises(incluster.CorruptCheckpointError, match="not valid JSON"):
        parse_received_sidecar(b"[" * 100_000, "peer", rank=0, step=2, job=JOB, size=size)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(ranks=[{"rank": "../../x", "size": 1, "checksum": {}}]),
        lambda m: m.update(world_size=5),
        lambda m: m["ranks"][0].update(size=-1),
        lambda m: m["ranks"][0]["checksum"].update(digests=["0" * 16]),
        lambda m: m.update(ranks="not a list"),
    ],
)
def test_a_tampered_manifest_falls_back_to_the_older_persistent_step(local_dir, tmp_path, caplog, change):
    root = str(tmp_path / "persist")
    _save(local_dir, persistent=root, persistent_every=1)
    manifest = os.path.join(root, JOB, "step-000000000002", "COMMITTED.json")
    m = json.load(open(manifest))
    change(m)
    json.dump(m, open(manifest, "w"))
    shutil.rmtree(os.path.join(local_dir, JOB))  # RAM gone: only the persistent tier is left
    step, target = _load(local_dir, persistent=root)
    assert step == 1 and torch.equal(target["w"], _state(1.0)["w"])


def test_files_are_private_to_the_user(local_dir, tmp_path):
    root = str(tmp_path / "persist")
    _save(local_dir, persistent=root, persistent_every=1)
    for top in (os.path.join(local_dir, JOB), os.path.join(root, JOB)):
        for dirpath, dirs, files in os.walk(top):
            assert os.stat(dirpath).st_mode & 0o777 == 0o700, dirpath
            for f in files:
                assert os.stat(os.path.join(dirpath, f)).st_mode & 0o777 == 0o600, f


def test_two_jobs_on_one_node_never_see_each_others_files(local_dir):
    with incluster.Checkpointer(local_dir=local_dir, job="alpha", writer="thread") as a, \
            incluster.Checkpointer(local_dir=local_dir, job="beta", writer="thread") as b:
        for s in (1, 2, 3):
            a.save(s, _state(float(s))).wait()
        b.save(7, _state(7.0)).wait()
    before = sorted(os.listdir(os.path.join(local_dir, "alpha", "rank-00000")))
    target = _state(0.0)
    with incluster.Checkpointer(local_dir=local_dir, job="beta", writer="thread") as b:
        assert b.load(target) == 7
        for s in (8, 9, 10):
            b.save(s, _state(float(s))).wait()
    assert torch.equal(target["w"], _state(7.0)["w"])
    assert sorted(os.listdir(os.path.join(local_dir, "alpha", "rank-00000"))) == before
    with incluster.Checkpointer(local_dir=local_dir, job="gamma", writer="thread") as g:
        assert g.load(_state(0.0)) is None  # a job with nothing of its own starts afresh
    for bad in ("../alpha", "a/b", "..", ".hidden"):
        with pytest.raises(ValueError, match="job"):
            incluster.Checkpointer(local_dir=local_dir, job=bad, writer="thread")
