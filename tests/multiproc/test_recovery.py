"""Recovery with real processes (gloo): spares, swapped nodes, corrupt copies, lost nodes.

Each scenario saves with 4 ranks, changes the cluster (folders wiped, nodes swapped),
restarts every rank, and checks that each rank's restored state is bitwise the state it
had when that step was saved.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time

import pytest

from incluster.testing import FaultInjector
from helpers import flip_byte
from test_multirank import _assert_restored, _run

pytestmark = pytest.mark.multiproc

THREAD = {"WRITER": "thread"}
NODES = ["A", "B", "C", "D"]


def _first(local_dir, nodes=NODES, rpn=1):
    codes, first, job = _run(local_dir, 0, nodes=nodes, rpn=rpn, env=THREAD)
    assert codes == [0] * len(first), [job.output(r) for r in range(len(first))]
    return first


@pytest.fixture(scope="module")
def saved4():
    """One save by 4 ranks on nodes A-D (steps 2 and 4), shared by the tests below: each
    restores from its own copy of the RAM folders (see :func:`_copy`)."""
    base = tempfile.mkdtemp(prefix="incluster-test-saved-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        yield base, _first(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _copy(saved, local_dir):
    base, first = saved
    shutil.copytree(base, local_dir, dirs_exist_ok=True)
    return first


def test_spare_replaces_a_wiped_node_and_two_nodes_swap(local_dir, saved4):
    first = _copy(saved4, local_dir)
    shutil.rmtree(os.path.join(local_dir, "B"))  # node B is gone with its RAM
    after = ["C", "E", "A", "D"]  # spare E takes B's place; A and C swap positions
    codes, second, job = _run(local_dir, 1, nodes=after, env=THREAD)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 4)
    sources = {r: (res["restore"]["source"], res["restore"]["source_node"]) for r, res in second.items()}
    assert sources[3] == ("local", "D")
    assert sources[1] == ("peer", "C")  # B's replica lived on C
    assert all(sources[r][0] == "peer" for r in (0, 1, 2))
    assert "from rank" in job.output(1) and "step 4" in job.output(1)
    # healed: the spare now holds rank 1's shard of step 4 in its own RAM folder
    assert os.path.exists(os.path.join(local_dir, "E", "mp", "rank-00001", "step-000000000004.json"))


def test_spare_for_a_node_of_two_ranks(local_dir):
    first = _first(local_dir, nodes=["A", "B"], rpn=2)
    shutil.rmtree(os.path.join(local_dir, "B"))
    codes, second, job = _run(local_dir, 1, nodes=["A", "S"], rpn=2, env=THREAD)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 4)
    assert [second[r]["restore"]["source"] for r in range(4)] == ["local", "local", "peer", "peer"]


def test_corrupt_byte_uses_the_replica_and_says_so(local_dir, saved4):
    first = _copy(saved4, local_dir)
    shard = os.path.join(local_dir, "C", "mp", "rank-00002", "step-000000000004.safetensors")
    flip_byte(shard)
    codes, second, job = _run(local_dir, 1, nodes=NODES, env=THREAD)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 4)
    r2 = second[2]["restore"]
    assert r2["source"] == "peer" and r2["source_node"] == "D"
    assert any("failed verification" in n and "checksum mismatch" in n for n in r2["notes"])
    assert "checksum mismatch" in job.output(2)


def test_lost_node_and_its_replica_partner_is_a_clear_error(local_dir, saved4):
    _copy(saved4, local_dir)
    shutil.rmtree(os.path.join(local_dir, "A"))  # rank 0's own copy
    shutil.rmtree(os.path.join(local_dir, "B"))  # and its only replica
    codes, second, job = _run(local_dir, 1, nodes=["E", "F", "C", "D"], env=THREAD)
    assert codes == [3] * 4, [job.output(r) for r in range(4)]
    for res in second.values():
        kind, msg = res["load_error"]
        assert kind == "NoCheckpointError" and "rank(s) [0]" in msg and "step 4" in msg


def test_every_nodes_ram_wiped_restores_from_the_persistent_tier(local_dir, tmp_path):
    env = {**THREAD, "INCLUSTER_PERSISTENT": str(tmp_path / "persist")}
    codes, first, job = _run(local_dir, 0, nodes=["A", "B"], env=env)  # saves 2 (persistent) and 4
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    assert os.path.exists(tmp_path / "persist" / "mp" / "step-000000000002" / "COMMITTED.json")
    for node in ("A", "B"):
        shutil.rmtree(os.path.join(local_dir, node))  # a cluster-wide outage
    codes, second, job = _run(local_dir, 1, nodes=["A", "B"], env=env)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 2)
    assert all(res["restore"]["source"] == "persistent" for res in second.values())


def test_copies_of_abandoned_steps_are_dropped_everywhere_after_a_restore(local_dir, saved4):
    """Steps newer than the restored one belong to an abandoned timeline: no node may keep
    any copy of them (a later restore could mix it with the new timeline's step)."""
    first = _copy(saved4, local_dir)  # steps 2 and 4 everywhere
    shutil.rmtree(os.path.join(local_dir, "B"))
    # make step 4 incomplete: rank 1's only other copy (its replica on C) is lost too
    os.unlink(os.path.join(local_dir, "C", "mp", "rank-00001", "step-000000000004.json"))
    restarted = time.time()
    codes, second, job = _run(local_dir, 1, nodes=["A", "E", "C", "D"], env=THREAD, steps=6)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 2)
    # steps 4 and 6 of the new timeline are saved and complete; none of the old step 4 is left
    for r in range(4):
        assert second[r]["errors"] == {}, second[r]["errors"]
    markers = glob.glob(os.path.join(local_dir, "*", "mp", "rank-*", "step-000000000004.json"))
    assert len(markers) >= 8, markers  # every rank's shard and its replica
    for path in markers:
        with open(path) as f:
            created = json.load(f)["created"]
        assert created >= restarted, f"{path} is a commit record of the abandoned timeline"


def _flip_near_end(shard):
    """One bit of the shard's third-last byte flipped, as a bad DIMM would."""
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_corrupt_copy_found_in_transfer_falls_back_to_an_older_step_on_every_rank(local_dir, saved4):
    """Rank 1's only copy of step 4 (its replica on C) is corrupt: the receiver finds it
    chunk by chunk as the bytes land; ranks that already loaded step 4 from their own
    node load step 2 again, so every rank ends bitwise at step 2."""
    first = _copy(saved4, local_dir)  # steps 2 and 4 everywhere
    shutil.rmtree(os.path.join(local_dir, "B"))
    _flip_near_end(os.path.join(local_dir, "C", "mp", "rank-00001", "step-000000000004.safetensors"))
    codes, second, job = _run(local_dir, 1, nodes=["A", "E", "C", "D"], env=THREAD)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 2)
    r1 = second[1]["restore"]
    assert r1["source"] == "peer" and r1["source_node"] == "C" and r1["rounds"] == 2
    assert any("rejected" in n and "checksum mismatch" in n for n in r1["notes"])
    assert second[0]["restore"]["source"] == "local"


def test_a_peer_restores_heal_survives_buffers_changing_right_after_the_load(local_dir):
    """The received copy is written to the new node in the background, while training
    goes on; BatchNorm buffers change in the first forward pass. The healed copy must
    still be exactly the restored step: restore from it alone, bitwise."""
    env = {**THREAD, "BN": "1"}
    codes, first, job = _run(local_dir, 0, nodes=NODES, env=env)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    shutil.rmtree(os.path.join(local_dir, "B"))
    after = ["A", "E", "C", "D"]  # the spare E takes B's place: rank 1 receives from a peer
    slow_heal = FaultInjector().fail_at(phase="heal", action="slow").env()  # the forward pass comes first
    codes, second, job = _run(local_dir, 1, nodes=after, env={**env, "FORWARD_AFTER_LOAD": "1", **slow_heal})
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 4)
    assert second[1]["restore"]["source"] == "peer"
    assert "healed its node's copy of step 4" in job.output(1)
    _restores_from_the_heal_alone(local_dir, after, env, first)


def _restores_from_the_heal_alone(local_dir, after, env, first):
    """Every copy of rank 1's shard but the one healed on the spare E is removed: the next
    restart restores from that copy, bitwise."""
    for node in ("A", "C", "D"):
        shutil.rmtree(os.path.join(local_dir, node, "mp", "rank-00001"), ignore_errors=True)
    codes, third, job = _run(local_dir, 2, nodes=after, env=env)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(third, first, 4)
    assert third[1]["restore"]["source"] == "local" and third[1]["restore"]["source_node"] == "E"


@pytest.mark.parametrize("own_copy", ["good", "corrupt"])
def test_a_persistent_step_is_downloaded_only_by_the_ranks_that_lost_their_copy(local_dir, tmp_path, own_copy):
    """Rank 1 lost every copy of steps 2 and 4; rank 0 still holds its own. The persistent
    tier has step 2 complete: rank 1 downloads its shard, rank 0 reads its node's copy of
    the same step (never downloaded again, nor an obstacle: found by the crash campaign).
    A copy of rank 0's found bad as it loads is downloaded in the next round."""
    env = {**THREAD, "INCLUSTER_PERSISTENT": str(tmp_path / "persist")}
    codes, first, job = _run(local_dir, 0, nodes=["A", "B"], env=env)  # step 2 also goes to the tier
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    for node in ("A", "B"):
        shutil.rmtree(os.path.join(local_dir, node, "mp", "rank-00001"), ignore_errors=True)
    if own_copy == "corrupt":
        flip_byte(os.path.join(local_dir, "A", "mp", "rank-00000", "step-000000000002.safetensors"))
    codes, second, job = _run(local_dir, 1, nodes=["A", "B"], env=env)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 2)
    assert second[0]["restore"]["source"] == ("local" if own_copy == "good" else "persistent")
    assert second[1]["restore"]["source"] == "persistent"
    assert os.path.exists(os.path.join(local_dir, "B", "mp", "rank-00001", "step-000000000002.json"))


STAGED = {"WIRE_PIECE": "4096", "WIRE_WINDOW": "2"}  # the NCCL path's staged pieces, on CPU


def test_a_restore_through_bounded_staged_pieces_is_bitwise_and_heals_its_node(local_dir):
    """The path NCCL takes (every piece through a few reused buffers, never the whole
    shard), run with CPU buffers: a spare receives rank 1's shard in 4 KiB pieces, two per
    round, its state bitwise and its node's copy healed from those pieces alone; no
    transfer held more than 2 rounds x 2 pieces x 4 KiB per direction."""
    env = {**THREAD, "BN": "1"}  # a 280 KB buffer: many pieces of a live tensor
    codes, first, job = _run(local_dir, 0, nodes=NODES, env=env)
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    shutil.rmtree(os.path.join(local_dir, "B"))
    after = ["A", "E", "C", "D"]
    codes, second, job = _run(local_dir, 1, nodes=after, env={**env, **STAGED})
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 4)
    assert second[1]["restore"]["source"] == "peer" and second[1]["restore"]["source_node"] == "C"
    bound = 2 * 2 * 4096
    assert 0 < second[1]["wire_peak"] <= bound  # the receiver
    assert 0 < second[2]["wire_peak"] <= bound  # rank 2 on C sent rank 1's replica
    _restores_from_the_heal_alone(local_dir, after, env, first)


def test_a_corrupt_piece_on_the_staged_path_falls_back_to_an_older_step(local_dir, saved4):
    """A flipped byte near the end of the shard, found in its piece as it lands: the
    copy is rejected and every rank ends bitwise at step 2."""
    first = _copy(saved4, local_dir)
    shutil.rmtree(os.path.join(local_dir, "B"))
    _flip_near_end(os.path.join(local_dir, "C", "mp", "rank-00001", "step-000000000004.safetensors"))
    codes, second, job = _run(local_dir, 1, nodes=["A", "E", "C", "D"], env={**THREAD, **STAGED})
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    _assert_restored(second, first, 2)
    r1 = second[1]["restore"]
    assert r1["source"] == "peer" and any("checksum mismatch" in n for n in r1["notes"])
    assert 0 < second[1]["wire_peak"] <= 2 * 2 * 4096


def test_simulated_nodes_under_one_launcher_each_list_their_ram(local_dir):
    """Two ranks of one launcher (LOCAL_RANK 0 and 1) playing two nodes (INCLUSTER_NODE,
    a RAM folder each): the rank with LOCAL_RANK 1 is its node's only rank, so it must list
    that node's RAM; a wiped node 0 then restores from node 1's replica, not from scratch."""
    one_launcher = {0: {"LOCAL_WORLD_SIZE": "2"}, 1: {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}}
    codes, first, job = _run(local_dir, 0, nodes=["A", "B"], env=THREAD, rank_env=one_launcher)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    shutil.rmtree(os.path.join(local_dir, "A"))
    codes, second, job = _run(local_dir, 1, nodes=["A", "B"], env=THREAD, rank_env=one_launcher)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 4)
    assert second[0]["restore"]["source"] == "peer" and second[1]["restore"]["source"] == "local"
