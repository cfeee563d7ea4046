"""Data-parallel copies as replicas: a replica whose bytes equal the partner's own shard
is stored as a sidecar pointing at that shard (no bytes sent, no RAM used twice); a lost
node is restored from such shared copies, bitwise, with each rank's own values; a
corrupt shared copy is caught by its checksums and another copy is used."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from incluster.format.sidecar import read_sidecar
from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "dp_share_script.py")
NODES = ["n0", "n1", "n2", "n3"]


def _run(local_dir: str, out: str, phase: str, nodes: list[str], replicas: int = 2) -> list[dict]:
    job = launch([SCRIPT, out, phase, str(replicas)], nodes=nodes, ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(180)
    assert codes == [0] * len(nodes), [job.output(r)[-3000:] for r in range(len(nodes))]
    return [json.load(open(os.path.join(out, f"result-{phase}-r{r}.json"))) for r in range(len(nodes))]


def _step(local_dir: str, node: str, owner: int, ext: str) -> str:
    return os.path.join(local_dir, node, "dpshare", f"rank-{owner:05d}", f"step-000000000002.{ext}")


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def test_identical_shards_share_replicas_and_restore_a_lost_node(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    _run(local_dir, out, "save", NODES)
    for i, node in enumerate(NODES):
        # each node keeps one shard file (its own rank's); the two replicas it holds are sidecars
        assert len(glob.glob(os.path.join(local_dir, node, "dpshare", "rank-*", "step-*.safetensors"))) == 1, node
        for k in (1, 2):
            owner = (i - k) % 4
            sc = read_sidecar(_step(local_dir, node, owner, "json"))
            assert sc.rank == owner and sc.extra["shared_with"] == i and sc.extra["replica_on"] == node
            assert not os.path.exists(_step(local_dir, node, owner, "safetensors"))
    shutil.rmtree(os.path.join(local_dir, "n1"))  # rank 1's own copy is gone
    _flip_last_byte(_step(local_dir, "n2", 2, "safetensors"))  # rank 2's shard: also rank 1's shared copy on n2
    res = _run(local_dir, out, "load", ["n0", "spare", "n2", "n3"])
    assert [r["loaded"] for r in res] == [2] * 4, res
    assert all(r["equal"] and r["optim_state"] for r in res), res
    assert [r["own"] for r in res] == [{"rank": r, "position": 100 * r} for r in range(4)], res  # each its own
    notes = [n for r in res for n in r["notes"]]
    assert any("failed verification" in n for n in notes), notes
    assert any("from the identical shard of rank" in n for n in notes), notes
    # the spare's rank got its shard from a peer, healed it in, and says so (not "from its own node's RAM")
    assert res[1]["source"] == "peer", [(r["source"], r["notes"]) for r in res]
    # the healed copies are each node's own bytes now (a shared copy's record once came along
    # and pointed at the sender's neighbour's file on the healed node): read locally, as saved
    for node, r in (("spare", 1), ("n2", 2)):
        sc = read_sidecar(_step(local_dir, node, r, "json"))
        assert "shared_with" not in sc.extra and "replica_on" not in sc.extra, (node, sc.extra)
    again = _run(local_dir, out, "again", ["n0", "spare", "n2", "n3"])
    assert [r["loaded"] for r in again] == [2] * 4 and all(r["equal"] for r in again), again
    assert [r["source"] for r in again] == ["local"] * 4, [(r["source"], r["notes"]) for r in again]


def test_after_a_spare_and_a_swap_every_shared_copy_points_at_bytes_that_exist(local_dir):
    """A rank that moved onto a node holding its replica as a shared copy has no shard
    file of its own there; the replicas re-sent to it after the restore pointed at that
    missing file, and `incluster verify` called the healthy job corrupt."""
    import subprocess
    import sys

    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    _run(local_dir, out, "save", NODES, replicas=1)
    shutil.rmtree(os.path.join(local_dir, "n1"))
    moved = ["n0", "spare", "n3", "n2"]  # a spare for n1; n2 and n3 swap
    res = _run(local_dir, out, "load", moved, replicas=1)
    assert [r["loaded"] for r in res] == [2] * 4 and all(r["equal"] for r in res), res
    folders = [os.path.join(local_dir, n) for n in moved]
    for node in folders:
        for path in glob.glob(os.path.join(node, "dpshare", "rank-*", "step-*.json")):
            sc = read_sidecar(path)
            holder = sc.extra.get("shared_with")
            if holder is not None:
                assert os.path.isfile(os.path.join(node, "dpshare", f"rank-{holder:05d}", sc.shard)), (path, sc.extra)
    done = subprocess.run([sys.executable, "-m", "incluster", "verify", *folders], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_replica_lost_node_and_corrupt_shared_copy_rebuilt_from_another_peer(local_dir):
    """replicas=1: rank 1's only other copy is its sidecar on n2, sharing rank 2's bytes.
    With n1 lost and those bytes corrupt, rank 1's sidecar goes to a node whose own
    shard is identical, and the restore takes step 2 from there, bitwise."""
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    _run(local_dir, out, "save", NODES, replicas=1)
    for i, node in enumerate(NODES):
        files = glob.glob(os.path.join(local_dir, node, "dpshare", "rank-*", "step-*.safetensors"))
        assert files == [_step(local_dir, node, i, "safetensors")], node  # no replica bytes anywhere
        sc = read_sidecar(_step(local_dir, node, (i - 1) % 4, "json"))
        assert sc.extra["shared_with"] == i
    shutil.rmtree(os.path.join(local_dir, "n1"))
    _flip_last_byte(_step(local_dir, "n2", 2, "safetensors"))
    res = _run(local_dir, out, "load", ["n0", "spare", "n2", "n3"], replicas=1)
    assert [r["loaded"] for r in res] == [2] * 4, res
    assert all(r["equal"] and r["optim_state"] for r in res), res
    assert [r["own"] for r in res] == [{"rank": r, "position": 100 * r} for r in range(4)], res
    notes = [n for r in res for n in r["notes"]]
    assert any("failed verification" in n or "rejected" in n for n in notes), notes
    assert any("rank 1's step 2 rebuilt on" in n for n in notes), notes


def test_a_rank_that_received_its_shard_in_an_earlier_round_says_it_came_from_a_peer(local_dir):
    """Rank 1 (on a new node) receives and heals its shard in the first round, which rank
    0's corrupt copy makes the job plan again: the second round sees rank 1's healed copy
    as local, and the report said "from its own node's RAM"."""
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    _run(local_dir, out, "save", NODES[:3], replicas=1)
    shutil.rmtree(os.path.join(local_dir, "n1"))
    _flip_last_byte(_step(local_dir, "n0", 0, "safetensors"))
    res = _run(local_dir, out, "load", ["n0", "n4", "n2"], replicas=1)
    assert [r["loaded"] for r in res] == [2] * 3 and all(r["equal"] for r in res), res
    assert [r["source"] for r in res] == ["peer", "peer", "local"], [(r["source"], r["notes"]) for r in res]
