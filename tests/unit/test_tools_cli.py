"""``incluster ls / verify / export``, run as an operator runs them, on real and damaged folders.

Two fixtures: a real single-rank checkpoint written by a Checkpointer, and a two-node,
two-rank DTensor checkpoint (each node keeps its own shard and a replica of the other's)
written with the project's own format code, as the writer and the replicator write it.
A few tests start the real command line in a subprocess; the rest call the same parser
in-process (each subprocess pays torch's import time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from helpers import write_shard
from incluster.format.sidecar import Sidecar, record_digest, write_sidecar
from incluster.staging.slots import sidecar_file, step_file

CLI = [sys.executable, "-m", "incluster"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env)


def inproc(capsys: Any, *args: str) -> tuple[int, str]:
    """The same commands in this process: (exit code, stdout + stderr)."""
    import incluster.tools as tools

    parser = argparse.ArgumentParser(prog="incluster")
    tools.register(parser.add_subparsers())
    ns = parser.parse_args(list(args))
    code = ns.func(ns)
    got = capsys.readouterr()
    return code, got.out + got.err


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


# -- fixtures ---------------------------------------------------------------------------
W = torch.arange(24, dtype=torch.float32).reshape(4, 6)  # Shard(0) over 2 ranks
E = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # Shard(1), uneven 3 + 2
B = torch.linspace(0, 1, 6, dtype=torch.float64)  # Replicate


def _dt(name: str, placement: list[Any], full: torch.Tensor, offset: list[int], local: torch.Tensor) -> dict[str, Any]:
    return {"D": name, "mesh_shape": [2], "mesh_dims": ["tp"], "placements": [placement],
            "global_shape": list(full.shape), "global_offset": offset, "local_shape": list(local.shape)}


def rank_state(rank: int) -> tuple[dict[str, torch.Tensor], Any]:
    w, e = W[2 * rank : 2 * rank + 2], (E[:, :3] if rank == 0 else E[:, 3:])
    tensors = {"model/w": w.clone(), "model/e": e.clone(), "model/b": B.clone(), "step": torch.tensor(7)}
    if rank == 1:
        tensors["rank1_only"] = torch.ones(2, dtype=torch.int16)
    model = {"d": [["w", _dt("model/w", ["S", 0], W, [2 * rank, 0], w)],
                   ["e", _dt("model/e", ["S", 1], E, [0, 3 * rank], e)],
                   ["b", _dt("model/b", ["R"], B, [0], B)]]}
    items = [["model", {"S": "module", "v": model}], ["step", {"T": "step"}],
             ["progress", {"d": [["step", {"v": 5}], ["lr", {"f": "nan"}], ["name", {"v": f"rank{rank}"}]]}]]
    if rank == 1:
        items.append(["rank1_only", {"T": "rank1_only"}])
    return tensors, {"d": items}


@pytest.fixture
def cluster(local_dir: str) -> dict[str, str]:
    """Two node folders, job j, step 10: each node holds its rank's shard and the other's replica."""
    nodes = {"nodeA": os.path.join(local_dir, "nodeA"), "nodeB": os.path.join(local_dir, "nodeB")}
    for rank, (own, other) in enumerate((("nodeA", "nodeB"), ("nodeB", "nodeA"))):
        tensors, tree = rank_state(rank)
        kw = dict(job="j", step=10, rank=rank, world=2, node=own, tensors=tensors, tree=tree)
        write_shard(os.path.join(nodes[own], "j", f"rank-{rank:05d}"), **kw)  # type: ignore[arg-type]
        write_shard(os.path.join(nodes[other], "j", f"rank-{rank:05d}"), extra={"replica_on": other}, **kw)  # type: ignore[arg-type]
    return nodes


def shard_of(node_dir: str, rank: int, step: int = 10) -> str:
    return os.path.join(node_dir, "j", f"rank-{rank:05d}", step_file(step))


def flip_byte(path: str, at: int = -3) -> None:
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END)
        b = f.read(1)
        f.seek(at, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def real(local_dir: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A real single-rank checkpoint (steps 2 and 3) and the model state saved at step 3."""
    import incluster

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters())
    ckpt = incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread", node="n0")
    try:
        for step in (1, 2, 3):
            model(torch.randn(4, 8)).sum().backward()
            optim.step()
            ckpt.save(step, {"model": model, "optim": optim, "meta": {"step": step}}).wait()
    finally:
        ckpt.close()
    return local_dir, {k: v.clone() for k, v in model.state_dict().items()}


# -- as a user runs them (subprocess) -----------------------------------------------------
def test_ls_two_nodes_shows_ranks_nodes_tiers(cluster: dict[str, str]) -> None:
    out = cli("ls", cluster["nodeA"], cluster["nodeB"])
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.split()[:2] == ["j", "10"])
    for word in ("10", "2/2", "nodeA, nodeB", "ram, replica", "complete"):
        assert word in row, row


def test_ls_and_verify_without_dir_read_this_nodes_ram_folder_and_fit_80_columns(
        real: tuple[str, dict[str, torch.Tensor]]) -> None:
    root, _ = real
    env = {**os.environ, "COLUMNS": "80", "INCLUSTER_LOCAL_DIR": root}
    out = subprocess.run([*CLI, "ls"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line.rstrip()) <= 80 for line in lines), out.stdout
    assert any(line.split()[:3] == ["j", "3", "1/1"] and line.rstrip().endswith("complete") for line in lines), out.stdout
    out = subprocess.run([*CLI, "verify"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "OK: 2 copies checked, 0 corrupt" in out.stdout, out.stdout + out.stderr


def test_verify_names_the_corrupt_file_and_fails(cluster: dict[str, str]) -> None:
    bad = shard_of(cluster["nodeB"], 0)  # the replica of rank 0
    flip_byte(bad)
    out = cli("verify", cluster["nodeA"], cluster["nodeB"])
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"FAULT: {bad}: checksum mismatch" in out.stdout
    assert "1 corrupt" in out.stdout and "0 incomplete" in out.stdout


def test_missing_sidecar_export_refuses(cluster: dict[str, str], tmp_path: Any) -> None:
    for node in cluster.values():
        os.unlink(os.path.join(node, "j", "rank-00001", sidecar_file(10)))
    dest = str(tmp_path / "full.safetensors")
    out = cli("export", *cluster.values(), "--step", "10", "--to", "safetensors", dest)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "refused" in out.stdout and "rank 1: no copy with a sidecar" in out.stdout
    assert not os.path.exists(dest) and not os.path.exists(dest + ".json")


def test_export_assembles_dtensor_shards(cluster: dict[str, str], tmp_path: Any) -> None:
    from safetensors.torch import load_file

    dest = str(tmp_path / "full.safetensors")
    out = cli("export", cluster["nodeA"], cluster["nodeB"], "--step", "10", "--to", "safetensors", dest)
    assert out.returncode == 0, out.stdout + out.stderr
    got = load_file(dest)
    assert set(got) == {"model/w", "model/e", "model/b", "step", "rank1_only"}
    assert torch.equal(got["model/w"], W) and torch.equal(got["model/e"], E) and torch.equal(got["model/b"], B)
    assert got["model/e"].dtype == torch.bfloat16 and int(got["step"]) == 7
    side = json.loads(open(dest + ".json").read())
    assert side["step"] == 10 and side["world_size"] == 2
    assert side["leaves"] == {"progress/step": 5, "progress/lr": "nan", "progress/name": "rank0"}


def test_export_names_values_that_differ_between_ranks(local_dir: str, tmp_path: Any, capsys: Any) -> None:
    """A plain tensor or value that each rank holds with its own value (a per-rank counter,
    an RNG state): the export takes rank 0's, and said nothing of the others."""
    node = os.path.join(local_dir, "n")
    for rank in range(2):
        tensors, tree = rank_state(rank)
        tensors["step"] = torch.tensor(7 + rank)  # rank 1's counter moved on
        write_shard(os.path.join(node, "j", f"rank-{rank:05d}"), job="j", step=10, rank=rank, world=2, node="n",
                    tensors=tensors, tree=tree)
    code, text = inproc(capsys, "export", node, "--step", "10", "--to", "torch", str(tmp_path / "out.pt"))
    assert code == 0, text
    said = " ".join(text.split())
    assert "2 value(s) differ between ranks; the export holds the first rank's of each" in said, said
    assert "step (rank 1)" in said and "progress/name (rank 1)" in said and "model/b" not in said, said
    assert int(torch.load(str(tmp_path / "out.pt"))["step"]) == 7


def test_real_checkpoint_verify_ok_and_garbage_is_info(real: tuple[str, dict[str, torch.Tensor]]) -> None:
    root, _ = real
    folder = os.path.join(root, "j", "rank-00000")
    open(os.path.join(folder, ".staging-9"), "wb").close()
    open(os.path.join(folder, sidecar_file(4) + ".tmp-123"), "wb").close()
    open(os.path.join(folder, sidecar_file(1) + ".bad"), "wb").close()  # a restore set a bad copy's record aside
    open(os.path.join(folder, step_file(1)), "wb").close()
    out = cli("verify", root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: 2 copies checked, 0 corrupt" in out.stdout
    assert ".staging-9: staging slot" in out.stdout and "half-written sidecar" in out.stdout
    said = " ".join(out.stdout.split())
    assert "the commit record of a copy a restore found bad, set aside" in said and "unknown file" not in said
    assert "a shard a restore found bad" in said
    assert "FAULT" not in out.stdout


# -- the same commands in-process: details ------------------------------------------------
def test_missing_sidecar_ls_incomplete_verify_fails(cluster: dict[str, str], capsys: Any) -> None:
    for node in cluster.values():
        os.unlink(os.path.join(node, "j", "rank-00001", sidecar_file(10)))
    code, text = inproc(capsys, "ls", *cluster.values())
    assert code == 0 and "1/2" in text and "incomplete: no copy of rank 1" in text, text
    assert "shard without a sidecar" in text  # the orphaned shards: info only
    code, text = inproc(capsys, "verify", *cluster.values(), "--step", "10")
    assert code == 1 and "rank 1 cannot be restored: it has no copy with a sidecar anywhere" in text, text


def test_real_checkpoint_ls_and_export_both_formats(real: tuple[str, dict[str, torch.Tensor]], tmp_path: Any,
                                                    capsys: Any) -> None:
    from safetensors.torch import load_file

    root, model = real
    code, text = inproc(capsys, "ls", root)
    rows = [line.split() for line in text.splitlines()]
    assert code == 0 and ["j", "3", "1/1", "1", "n0", "ram"] in [r[:6] for r in rows], text
    assert "complete" in text, text
    code, text = inproc(capsys, "export", os.path.join(root, "j"), "--step", "3", "--to", "safetensors",
                        str(tmp_path / "m.safetensors"))
    assert code == 0, text
    got = load_file(str(tmp_path / "m.safetensors"))
    for k, v in model.items():
        assert torch.equal(got[f"model/{k}"], v)
    assert "optim/state/0/exp_avg" in got
    leaves = json.loads((tmp_path / "m.safetensors.json").read_text())["leaves"]
    assert leaves["meta/step"] == 3 and leaves["optim/param_groups/0/lr"] == 0.001
    code, text = inproc(capsys, "export", root, "--step", "3", "--to", "torch", str(tmp_path / "m.pt"))
    assert code == 0, text
    obj = torch.load(str(tmp_path / "m.pt"), weights_only=True)
    assert torch.equal(obj["model/0.weight"], model["0.weight"]) and obj["meta/step"] == 3


def test_export_names_pickled_values_and_how_to_read_them(local_dir: str, tmp_path: Any, capsys: Any) -> None:
    """A pickled object is exported as the uint8 tensor of its bytes, never unpickled: a
    user who finds a uint8 tensor where a Fraction was must be told which and why."""
    import fractions
    import pickle

    import incluster

    with incluster.Checkpointer(local_dir=local_dir, job="pk", node="n0", replicas=0, allow_pickle=True,
                                writer="thread") as ck:
        ck.save(1, {"w": torch.ones(3), "extra": {"frac": fractions.Fraction(1, 3)}}).wait(30)
    for fmt in ("torch", "safetensors"):
        code, text = inproc(capsys, "export", local_dir, "--step", "1", "--to", fmt, str(tmp_path / f"x.{fmt}"))
        said = " ".join(text.split())
        assert code == 0 and "1 value(s) were pickled objects" in said and "extra/frac" in said, said
        assert "pickle.loads(t.numpy().tobytes())" in said, said
    t = torch.load(str(tmp_path / "x.torch"), weights_only=True)["extra/frac"]
    assert t.dtype == torch.uint8 and pickle.loads(t.numpy().tobytes()) == fractions.Fraction(1, 3)


def test_export_uses_a_replica_when_the_own_copy_is_corrupt(cluster: dict[str, str], tmp_path: Any,
                                                            capsys: Any) -> None:
    flip_byte(shard_of(cluster["nodeA"], 0))
    code, text = inproc(capsys, "export", *cluster.values(), "--step", "10", "--to", "torch", str(tmp_path / "x.pt"))
    assert code == 0, text
    assert f"rank 0: {os.path.join(cluster['nodeB'], 'j', 'rank-00000', sidecar_file(10))} (replica on nodeB)" in text
    obj = torch.load(str(tmp_path / "x.pt"), weights_only=True)
    assert torch.equal(obj["model/w"], W) and math.isnan(obj["progress/lr"]) and obj["progress/name"] == "rank0"


def test_export_never_overwrites_and_names_the_steps_there(cluster: dict[str, str], tmp_path: Any,
                                                          capsys: Any) -> None:
    """--to torch and safetensors replaced an existing OUT silently (dcp refused it)."""
    for fmt in ("torch", "safetensors"):
        out = tmp_path / f"old.{fmt}"
        out.write_bytes(b"keep me")
        code, text = inproc(capsys, "export", *cluster.values(), "--step", "10", "--to", fmt, str(out))
        assert code == 2 and "already exists; remove it or choose another OUT" in text, text
        assert out.read_bytes() == b"keep me"
    code, text = inproc(capsys, "export", *cluster.values(), "--step", "4", "--to", "torch", str(tmp_path / "n.pt"))
    assert code == 1 and "no step 4 found" in text and "steps there: 10" in text, text


def test_export_refuses_when_every_copy_of_a_rank_is_corrupt(cluster: dict[str, str], tmp_path: Any,
                                                             capsys: Any) -> None:
    for node in cluster.values():
        flip_byte(shard_of(node, 1))
    code, text = inproc(capsys, "export", *cluster.values(), "--step", "10", "--to", "torch", str(tmp_path / "x.pt"))
    assert code == 1 and "rank 1:" in text and text.count("checksum mismatch") == 2, text
    assert not (tmp_path / "x.pt").exists()


def test_export_refuses_a_missing_dtensor_shard(local_dir: str, tmp_path: Any, capsys: Any) -> None:
    # World size 2 but both ranks claim the same Shard(0) offset: half of W is nowhere.
    for rank in (0, 1):
        tensors, tree = rank_state(0)
        write_shard(os.path.join(local_dir, "j", f"rank-{rank:05d}"), job="j", step=1, rank=rank, world=2,
                    node="n", tensors=tensors, tree=tree)
    code, text = inproc(capsys, "export", local_dir, "--step", "1", "--to", "torch", str(tmp_path / "x.pt"))
    assert code == 1 and "model/w: the shards cover 12 of 24 elements" in text, text


def test_a_copy_with_an_unreadable_sidecar_is_shown_on_its_node_not_its_folders_name(local_dir: str,
                                                                                        capsys: Any) -> None:
    """The RAM folder is usually /dev/shm/incluster: ls named the node "incluster" for a
    copy whose sidecar cannot be read, beside the real node name of its other copies."""
    folder = os.path.join(local_dir, "incluster", "j", "rank-00000")
    for step in (1, 2):
        write_shard(folder, job="j", step=step, rank=0, world=1, node="host-a",
                    tensors={"w": torch.ones(4)}, tree={"d": [["w", {"T": "w"}]]})
    with open(os.path.join(folder, sidecar_file(2)), "w") as f:
        f.write("{not json")
    code, text = inproc(capsys, "ls", os.path.join(local_dir, "incluster"))
    rows = [r.split() for r in text.splitlines()]
    step2 = [r for r in rows if r[:2] == ["j", "2"]]
    assert step2 and "host-a" in step2[0] and "incluster" not in step2[0], text


def test_truncated_shard_and_bad_sidecar_are_faults(cluster: dict[str, str], capsys: Any) -> None:
    with open(shard_of(cluster["nodeA"], 1), "r+b") as f:
        f.truncate(100)
    with open(os.path.join(cluster["nodeB"], "j", "rank-00001", sidecar_file(10)), "w") as f:
        f.write("{not json")
    code, text = inproc(capsys, "verify", *cluster.values())
    assert code == 1, text
    assert "100 bytes on disk but the sidecar says" in text and "sidecar is not valid JSON" in text
    assert "rank 1 cannot be restored: all 2 of its copies are corrupt" in text
    code, text = inproc(capsys, "ls", *cluster.values())
    # rank 1 still has one sidecar, but no usable copy: the ranks column counts usable ones
    assert code == 0 and "unreadable sidecar" in text and "1/2" in text, text
    # ls reads no shard bytes, but a shard file of the wrong size is not a usable copy
    assert "every copy of rank 1 is damaged" in text and "damaged copy:" in text and "complete" not in text.replace(
        "incomplete", ""), text


def test_a_rank_folder_given_as_dir_is_named_with_its_job_folder(cluster: dict[str, str], capsys: Any) -> None:
    rank_dir = os.path.join(cluster["nodeA"], "j", "rank-00000")
    for cmd in ("verify", "ls"):
        code, text = inproc(capsys, cmd, rank_dir)
        assert "is one rank's folder: name its job folder" in " ".join(text.split()), text
        assert os.path.join(cluster["nodeA"], "j") in text.replace("\n", ""), text
        assert code == 1, (cmd, code)  # a wrong path, not an empty folder: a script must see it


def test_a_tier_step_folder_given_as_dir_is_named_with_the_tier(tmp_path: Any, capsys: Any) -> None:
    step_dir = tmp_path / "tier" / "j" / "step-000000000010"
    step_dir.mkdir(parents=True)
    code, text = inproc(capsys, "ls", str(step_dir))  # it said "no checkpoints found" and exited 0
    assert code == 1 and f"name the tier (--persistent {tmp_path / 'tier'})" in text.replace("\n", ""), text


def test_an_incomplete_step_newer_than_the_restorable_one_is_a_warning_not_a_fault(cluster: dict[str, str],
                                                                                  capsys: Any) -> None:
    """After a crash, a save only rank 0 committed (step 12) sits beside complete step 10.
    That is what a crash leaves, and also what a node lost with its copies leaves: the
    listing cannot tell which, so verify warns (exit 3), names the step a restore would
    use - and a health check need not fail after every crash."""
    tensors, tree = rank_state(0)
    write_shard(os.path.join(cluster["nodeA"], "j", "rank-00000"), job="j", step=12, rank=0, world=2, node="nodeA",
                tensors=tensors, tree=tree)
    code, text = inproc(capsys, "verify", *cluster.values())
    assert code == 3 and "FAULT" not in text and "WARNING: job j: a restore would use step 10, but step(s) 12" in text, text
    assert "newest step with a good copy of every rank is 10" in text
    code, text = inproc(capsys, "verify", *cluster.values(), "--step", "10")  # a newer step exists: not "newest"
    assert code == 0 and "job j: step 10 has a good copy of every rank" in text and "newest" not in text, text
    code, text = inproc(capsys, "verify", *cluster.values(), "--step", "12")  # asked for: a fault
    assert code == 1 and "rank 1 cannot be restored: it has no copy with a sidecar anywhere" in text, text
    for node in cluster.values():  # nothing complete left at all: a fault
        os.unlink(os.path.join(node, "j", "rank-00001", sidecar_file(10)))
    code, text = inproc(capsys, "verify", *cluster.values())
    assert code == 1 and "job j: no step has a good copy of every rank" in text, text


def test_one_nodes_folder_of_a_larger_job_is_checked_not_judged(local_dir: str, capsys: Any) -> None:
    """`incluster verify` on one node (no replicas) sees only its ranks: its copies are
    checked, but no step can look restorable there, and that is no fault."""
    tensors, tree = rank_state(0)
    write_shard(os.path.join(local_dir, "j", "rank-00000"), job="j", step=10, rank=0, world=2, node="a",
                tensors=tensors, tree=tree)
    code, text = inproc(capsys, "verify", local_dir)
    assert code == 0 and "FAULT" not in text and "no folder given holds rank(s) 1" in text, text
    code, text = inproc(capsys, "ls", local_dir)  # it said "incomplete: no copy of rank 1", in red
    flat = " ".join(text.split())
    assert code == 0 and "incomplete" not in flat and "rank 1 not in the folders listed" in flat, text
    assert "job j: no folder listed holds rank(s) 1" in flat, text


def test_persistent_tier_is_listed_verified_and_exported(cluster: dict[str, str], tmp_path: Any,
                                                         capsys: Any) -> None:
    root = tmp_path / "persist"
    d = root / "j" / "step-000000000010"
    d.mkdir(parents=True)
    infos = []
    for rank in (0, 1):
        src = os.path.join(cluster["nodeA"], "j", f"rank-{rank:05d}")
        shutil.copy(os.path.join(src, step_file(10)), d / f"rank-{rank:05d}.safetensors")
        sc = json.loads(open(os.path.join(src, sidecar_file(10))).read())
        sc["extra"] = {}
        sc.pop("digest")
        sc["digest"] = record_digest(sc)  # the record re-sealed after the edit, as the uploader writes it
        (d / f"rank-{rank:05d}.json").write_text(json.dumps(sc))
        infos.append({"rank": rank, "size": sc["checksum"]["size"], "checksum": sc["checksum"]})
    (d / "COMMITTED.json").write_text(json.dumps({"format": "incluster-manifest", "version": 1, "job": "j",
                                                  "step": 10, "world_size": 2, "ranks": infos, "created": time.time()}))
    (root / "j" / "step-000000000012").mkdir()  # an upload that never got its manifest
    code, text = inproc(capsys, "ls", str(root))
    assert code == 0 and "persistent" in text and "2/2" in text and "without a COMMITTED.json" in text, text
    assert "damaged" not in text, text
    code, text = inproc(capsys, "verify", f"file://{root}/j", "--step", "10")
    assert code == 0 and "OK: 2 copies checked" in text, text
    code, text = inproc(capsys, "export", str(root), "--step", "10", "--to", "safetensors", str(tmp_path / "p.st"))
    assert code == 0 and "(persistent on persistent)" not in text and "persistent" in text, text
    code, text = inproc(capsys, "export", "--persistent", str(root), "--step", "10", "--to", "torch",
                        str(tmp_path / "p.pt"))  # no DIR: the tier alone (OUT was taken for a DIR)
    assert code == 0 and os.path.exists(tmp_path / "p.pt"), text
    code, text = inproc(capsys, "export", "--step", "10", "--to", "torch", str(tmp_path / "q.pt"))
    assert code == 2 and "name where the checkpoint is" in text, text
    # Together with the RAM folders: six copies, and a corrupt persistent shard is a fault.
    flip_byte(str(d / "rank-00001.safetensors"))
    code, text = inproc(capsys, "verify", *cluster.values(), "--persistent", str(root))
    assert code == 1 and "6 copies checked, 1 corrupt" in text and "rank-00001.safetensors: checksum mismatch" in text
    os.truncate(d / "rank-00001.safetensors", 1000)  # ls sees a persistent shard of the wrong size too
    code, text = inproc(capsys, "ls", str(root))
    assert "every copy of rank 1 is damaged" in text and "rank-00001.safetensors: 1000 bytes on disk" in text, text
    (d / "SET_ASIDE.json").write_text(json.dumps({"step": 10, "why": "rank 1's shard: checksum mismatch"}))
    code, text = inproc(capsys, "ls", str(root))  # a restore set the step aside: named, with why
    assert "set aside by a restore that found a copy bad (rank 1's shard: checksum mismatch)" in text, text
    assert "damaged" not in text, text


def test_missing_dir_and_unknown_step(local_dir: str, capsys: Any) -> None:
    code, text = inproc(capsys, "ls", os.path.join(local_dir, "nope"))
    assert code == 2 and "no such folder" in text
    code, text = inproc(capsys, "verify", local_dir, "--step", "5")
    assert code == 1 and "no step 5 found" in text


def test_verify_of_a_step_not_there_names_the_steps_that_are(real: tuple[str, dict[str, torch.Tensor]],
                                                             capsys: Any) -> None:
    root, _ = real
    code, text = inproc(capsys, "verify", root, "--step", "7")
    assert code == 1 and "no step 7 found" in text and "(it holds steps 2, 3)" in text, text
    code, text = inproc(capsys, "verify", os.path.join(root, "j"), "--step", "3")
    assert code == 0 and "OK: 1 copy checked" in text, text


def test_ls_into_a_pipe_keeps_every_row_whole(local_dir: str) -> None:
    """A script reading `incluster ls | grep ...` must find a row whole: output that is no
    terminal is not cut to rich's default 80 columns."""
    import incluster

    job = "a-rather-long-job-name-that-would-wrap"
    with incluster.Checkpointer(local_dir=local_dir, job=job, writer="thread") as ck:
        ck.save(7, {"w": torch.ones(10)}).wait()
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([*CLI, "ls", local_dir], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert any(line.split()[:2] == [job, "7"] and line.rstrip().endswith("complete")
               for line in out.stdout.splitlines()), out.stdout


def test_a_url_with_an_unknown_protocol_is_an_error_naming_it_not_a_traceback(capsys: Any) -> None:
    for cmd in ("ls", "verify"):
        for url, says in (("foo://bar", "fsspec knows no protocol 'foo'"), ("S3://b/x", "write s3://"),
                          ("s3:/b/x", "s3:/ has one slash, so it would be a local folder named 's3:'; write s3://b/x")):
            code, text = inproc(capsys, cmd, url)
            assert code == 2 and says in text and "Traceback" not in text, (cmd, url, text)


def test_without_dir_a_missing_ram_folder_and_a_job_not_there_are_named(real: tuple[str, dict[str, torch.Tensor]],
                                                                     capsys: Any, monkeypatch: Any) -> None:
    """No DIR and no RAM folder on this node: the error suggested that very folder. A --job
    that is not there: verify said "no checkpoints found", ls listed nothing, neither why."""
    root, _ = real
    monkeypatch.setenv("INCLUSTER_LOCAL_DIR", os.path.join(root, "gone"))
    code, text = inproc(capsys, "ls")
    assert code == 2 and "no DIR given, and this node's RAM folder" in text and "its local_dir" in text, text
    for cmd in ("ls", "verify"):
        code, text = inproc(capsys, cmd, root, "--job", "nojob")
        assert code == 1 and "job 'nojob' is not there, these are: j" in text, (cmd, text)
    code, text = inproc(capsys, "export", root, "--job", "nojob", "--step", "1", "--to", "torch",
                        os.path.join(root, "out.pt"))
    assert code == 1 and "job 'nojob' is not there, these are: j" in text and "no steps there at all" not in text, text
    code, text = inproc(capsys, "verify", root, "--job", "j", "--step", "99")  # the job is there, the step is not
    assert code == 1 and "no step 99 found" in text and "is not there" not in text, text


def test_an_object_store_refusal_names_the_tier_and_what_to_check(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: Any) -> None:
    """botocore's own words ("The request signature we calculated does not match ...")
    name neither the URL nor the settings the commands read."""
    import incluster.tools.ui as ui

    def refused(*_: Any) -> None:
        raise PermissionError("The request signature we calculated does not match the signature you provided")

    monkeypatch.setattr(ui, "scan", refused)
    code, text = inproc(capsys, "ls", "--persistent", "s3://bucket/run")
    text = " ".join(text.split())
    assert code == 2 and "reading the persistent tier s3://bucket/run: The request signature" in text, text
    assert "AWS_SECRET_ACCESS_KEY" in text, text
