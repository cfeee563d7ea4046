"""Elastic restore: an FSDP2 job restarted with a different world size restores the
newest step from the cluster's RAM, resharded, bitwise, and trains on."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "reshard_script.py")


def _run(local_dir: str, out: str, phase: str, nodes: list[str], env: dict | None = None) -> list[dict]:
    # A restore runs in the trainer; its writer only re-replicates after it. Restores run
    # with the writer on threads (a writer process costs each rank a torch import on these
    # 2 cores), except where a test asks for the process (the first one does).
    env = {"WRITER": "thread", **(env or {})} if phase == "load" else env
    job = launch([SCRIPT, out, phase], nodes=nodes, ranks_per_node=1, base_dir=local_dir, env=env)
    codes = job.wait(180)
    assert codes == [0] * len(nodes), [job.output(r)[-3000:] for r in range(len(nodes))]
    return [json.load(open(os.path.join(out, f"result-{phase}-r{r}.json"))) for r in range(len(nodes))]


def _same_full_state(out: str) -> None:
    saved = torch.load(os.path.join(out, "full-save.pt"))
    loaded = torch.load(os.path.join(out, "full-load.pt"))
    assert sorted(saved) == sorted(loaded)
    for k in saved:
        assert saved[k].dtype == loaded[k].dtype and torch.equal(saved[k], loaded[k]), f"{k} differs"


NODES = ["n0", "n1", "n2", "n3"]


def _saved(name: str, env: dict) -> "object":
    """A module-wide save by 4 ranks (each test restores from its own copy of it): RAM
    folders, the persistent tier and the gathered full state, under one RAM-disk folder."""

    @pytest.fixture(scope="module", name=name)
    def fixture():
        base = tempfile.mkdtemp(prefix="incluster-test-saved-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            os.makedirs(os.path.join(base, "out"))
            _run(base, os.path.join(base, "out"), "save", NODES, {"RESHARD_PERSISTENT": os.path.join(base, "persistent"), **env})
            yield base
        finally:
            shutil.rmtree(base, ignore_errors=True)

    return fixture


fsdp4 = _saved("fsdp4", {})  # FSDP2 over 4 ranks
hsdp4 = _saved("hsdp4", {"RESHARD_MESH_SAVE": "2,2"})  # HSDP on a 2 x 2 mesh


def _copy(saved: str, local_dir: str) -> tuple[str, dict]:
    """This test's own copy of a module save: its out folder and the persistent tier env."""
    shutil.copytree(saved, local_dir, dirs_exist_ok=True)
    return os.path.join(local_dir, "out"), {"RESHARD_PERSISTENT": os.path.join(local_dir, "persistent")}


def _shard(local_dir: str, node: str, owner: int, step: int) -> str:
    return os.path.join(local_dir, node, "reshard", f"rank-{owner:05d}", f"step-{step:012d}.safetensors")


def test_four_ranks_lose_a_node_and_go_on_with_three(local_dir, fsdp4):
    out, _ = _copy(fsdp4, local_dir)
    shutil.rmtree(os.path.join(local_dir, "n3"))  # the node is gone and there is no spare
    # and old rank 1's own copy went bad in n1's RAM: its replica on n2 must be used
    path = _shard(local_dir, "n1", 1, 3)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 8)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    res = _run(local_dir, out, "load", ["n0", "n1", "n2"], {"WRITER": "process"})
    _same_full_state(out)
    assert [r["loaded"] for r in res] == [3, 3, 3] and {r["source"] for r in res} == {"reshard"}, res
    assert [r["position"] for r in res] == [1000, 1001, 1002], res  # each rank's own values: same number
    assert all(r["step4"] == "durable" for r in res)
    assert any("failed verification" in n for r in res for n in r["notes"]), res
    said = open(os.path.join(local_dir, ".logs", "rank-0.log")).read()  # old rank 3's own values are gone: say so
    assert ("saved by 4 ranks and restored into 3: the own values (plain tensors, RNG, data-loader position) of "
            "old rank(s) 3 are not restored") in said, said[-3000:]
    # once step 4 of the 3-rank world is durable, old rank 3's copies are dropped from n0's RAM
    assert not os.path.exists(os.path.join(local_dir, "n0", "reshard", "rank-00003"))


def test_resharding_through_bounded_staged_pieces_is_bitwise(local_dir, fsdp4):
    """The path NCCL takes, with CPU buffers: every piece (48 bytes: rows of a weight are
    cut in two) goes through a few reused buffers, never a whole tensor's worth."""
    out, _ = _copy(fsdp4, local_dir)
    shutil.rmtree(os.path.join(local_dir, "n3"))
    res = _run(local_dir, out, "load", ["n0", "n1", "n2"], {"WIRE_PIECE": "48"})
    _same_full_state(out)
    assert [r["loaded"] for r in res] == [3, 3, 3] and {r["source"] for r in res} == {"reshard"}, res
    peaks = [r["wire_peak"] for r in res]
    assert any(peaks) and all(p <= 2 * 2 * 2 * 48 * 3 for p in peaks), peaks  # in + out, 2 rounds x 2, per peer


def test_two_ranks_grow_to_four(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    _run(local_dir, out, "save", ["n0", "n1"])
    res = _run(local_dir, out, "load", ["n0", "n1", "n2", "n3"])
    _same_full_state(out)
    assert [r["loaded"] for r in res] == [3] * 4 and {r["source"] for r in res} == {"reshard"}, res
    # ranks beyond the old world take old rank (rank % 2)'s own values, and say so
    assert [r["position"] for r in res] == [1000, 1001, 1000, 1001], res
    assert all(r["step4"] == "durable" for r in res)


def test_every_node_lost_three_ranks_reshard_from_the_persistent_tier(local_dir, fsdp4):
    out, env = _copy(fsdp4, local_dir)
    for n in ("n0", "n1", "n2", "n3"):
        shutil.rmtree(os.path.join(local_dir, n))  # every node's RAM is gone
    res = _run(local_dir, out, "load", ["m0", "m1", "m2"], env)
    _same_full_state(out)
    assert [r["loaded"] for r in res] == [3, 3, 3] and {r["source"] for r in res} == {"reshard"}, res
    assert all("old shards fetched from the persistent tier" in r["notes"] for r in res), res
    assert all("from the persistent tier, resharded" in r["line"] for r in res), res  # not "the cluster's RAM"
    assert all(r["step4"] == "durable" for r in res)
    # old rank 0's shard was fetched into m0's RAM: its record names m0 (`incluster ls` showed n0, long gone)
    from incluster.format.sidecar import read_sidecar

    fetched = read_sidecar(os.path.join(local_dir, "m0", "reshard", "rank-00000", "step-000000000003.json"))
    assert fetched.node == "m0" and fetched.extra.get("restored_from") == "persistent", fetched


def test_hsdp_on_a_two_by_two_mesh_restores_into_three_ranks_of_fsdp(local_dir, hsdp4):
    out, _ = _copy(hsdp4, local_dir)
    shutil.rmtree(os.path.join(local_dir, "n3"))
    res = _run(local_dir, out, "load", ["n0", "n1", "n2"])
    _same_full_state(out)
    assert [r["loaded"] for r in res] == [3, 3, 3] and {r["source"] for r in res} == {"reshard"}, res


def test_same_world_size_on_another_mesh_is_resharded(local_dir, hsdp4):
    out, _ = _copy(hsdp4, local_dir)  # saved by HSDP 2 x 2
    res = _run(local_dir, out, "load", NODES)  # FSDP over all 4
    _same_full_state(out)
    assert [r["loaded"] for r in res] == [3] * 4 and {r["source"] for r in res} == {"reshard"}, res
    assert all(any("another mesh" in n for n in r["notes"]) for r in res), res


def test_a_persistent_step_on_another_mesh_at_the_same_size_is_resharded(local_dir, hsdp4):
    out, env = _copy(hsdp4, local_dir)
    for n in NODES:
        shutil.rmtree(os.path.join(local_dir, n))
    res = _run(local_dir, out, "load", ["m0", "m1", "m2", "m3"], env)
    _same_full_state(out)
    assert [r["loaded"] for r in res] == [3] * 4 and {r["source"] for r in res} == {"reshard"}, res


def test_ranks_that_disagree_on_the_rule_stop_together_with_the_reason(local_dir, fsdp4):
    out, _ = _copy(fsdp4, local_dir)
    job = launch([SCRIPT, out, "load"], nodes=["n0", "n1", "n2"], ranks_per_node=1, base_dir=local_dir,
                 rank_env={1: {"RESHARD_RULE": "rank0"}})
    codes = job.wait(120)  # no hang: every rank stops at the same collective
    assert all(c != 0 for c in codes), codes
    assert all("disagree" in job.output(r) for r in range(3)), [job.output(r)[-1500:] for r in range(3)]


def _refused_into_three(local_dir: str, saved: str, where: str, env: dict) -> list[str]:
    """The 4-rank save loaded by 3 ranks (from RAM, or with every node's RAM gone from the
    tier), which every rank must refuse: their outputs."""
    out, tier_env = _copy(saved, local_dir)
    if where == "tier":
        for n in NODES:
            shutil.rmtree(os.path.join(local_dir, n))  # every node's RAM is gone
    job = launch([SCRIPT, out, "load"], nodes=["n0", "n1", "n2"], ranks_per_node=1, base_dir=local_dir,
                 env={**tier_env, "WRITER": "thread", **env})
    codes = job.wait(120)
    assert all(c != 0 for c in codes), codes
    return [job.output(r) for r in range(3)]


@pytest.mark.parametrize("where", ["ram", "tier"])
def test_the_refuse_rule_says_so_from_ram_and_from_the_tier(local_dir, fsdp4, where):
    """From the tier, the step saved by 4 ranks was passed over with a bare warning, and
    load() ended saying its copies "failed verification or do not fit this job", advising
    to delete the node folders and the tier: good checkpoints."""
    outs = _refused_into_three(local_dir, fsdp4, where, {"RESHARD_RULE": "refuse"})
    said = "step 3 was saved by 4 ranks and this job has 3; reshard_rank_state='refuse' forbids restoring it here"
    assert all(said in o and "Restart with 4 ranks" in o for o in outs), [o[-1500:] for o in outs]
    assert not any("start afresh" in o or "old shards fetched" in o for o in outs), [o[-1500:] for o in outs]


@pytest.mark.parametrize("where", ["ram", "tier"])
def test_an_integration_that_cannot_resize_refuses_before_anything_is_restored(local_dir, fsdp4, where):
    """Lightning and accelerate refused a step saved by another number of processes only
    after load() had restored it into the live state, right after a warning that read as
    if the restore went on. From the tier, such a step must be refused too, not passed
    over for an older one of this size (the "refuse" rule's way)."""
    outs = _refused_into_three(local_dir, fsdp4, where, {"RESHARD_REFUSE": "the loop's positions are per process"})
    said = "step 3 was saved by 4 process(es) and this run has 3: the loop's positions are per process"
    assert all(said in o and "Resume with 4 process(es)" in o for o in outs), [o[-1500:] for o in outs]
    # a one-node launch with another number of processes finds the steps of a job named from
    # its script and folder: the way to start afresh is named, with the job's name
    assert all("to start afresh instead, name another job (job=...; this one is '" in o for o in outs), outs[0][-1500:]
    assert not any("restored into" in o or "reshard_rank_state" in o or "fetched" in o for o in outs), [
        o[-1500:] for o in outs]
