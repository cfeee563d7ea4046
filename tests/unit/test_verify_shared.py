"""A shared copy (a replica whose bytes are a data-parallel peer's own shard on the same
node) once its holder has reused that shard's slot for a newer save: ``incluster verify``
of a live, healthy job must not call it damage. Its record outlives the bytes until the
newer save is committed on every rank; the holder's ring is the real one doing the reuse."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from helpers import write_shard
from incluster.staging.slots import SlotRing, step_file

JOB = "j"
TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}  # data-parallel: both ranks the same
TREE = {"d": [["w", {"T": "w"}]]}


def _verify(capsys: Any, *dirs: str) -> tuple[int, str]:
    import incluster.tools as tools

    parser = argparse.ArgumentParser(prog="incluster")
    tools.register(parser.add_subparsers())
    ns = parser.parse_args(["verify", *dirs])
    code = ns.func(ns)
    got = capsys.readouterr()
    return code, got.out + got.err


def _node(local_dir: str) -> str:
    """Node A as a two-rank data-parallel job leaves it after steps 10 and 11: rank 0's own
    shards, and rank 1's replicas stored as records pointing at them."""
    node = os.path.join(local_dir, "nodeA")
    for step in (10, 11):
        kw: dict[str, Any] = dict(job=JOB, step=step, world=2, tensors=TENSORS, tree=TREE)
        write_shard(os.path.join(node, JOB, "rank-00000"), rank=0, node="nodeA", **kw)
        write_shard(os.path.join(node, JOB, "rank-00001"), rank=1, node="nodeB",
                    extra={"replica_on": "nodeA", "shared_with": 0}, **kw)
        os.unlink(os.path.join(node, JOB, "rank-00001", step_file(step)))  # a shared copy has no bytes of its own
    return node


def test_a_shared_copy_whose_holder_reused_the_slot_is_superseded_not_a_fault(local_dir: str, capsys: Any) -> None:
    node = _node(local_dir)
    assert _verify(capsys, node)[0] == 0
    ring = SlotRing(os.path.join(node, JOB, "rank-00000"), keep=2)  # rank 0's trainer, restarted: adopts 10, 11
    try:
        ring.set_global(11)
        ring.acquire(12, timeout=5)  # the save of step 12 takes step 10's slot
        assert not os.path.exists(os.path.join(node, JOB, "rank-00000", step_file(10)))
        code, out = _verify(capsys, node)
    finally:
        ring.close()
    assert code == 0, out
    assert "FAULT" not in out and "superseded" in out, out
    assert "newest step with a good copy of every rank is 11" in out, out


def test_a_shared_copy_whose_holder_lost_its_shard_is_still_a_fault(local_dir: str, capsys: Any) -> None:
    node = _node(local_dir)
    os.unlink(os.path.join(node, JOB, "rank-00000", step_file(10)))  # the holder's record stays: damage
    code, out = _verify(capsys, node)
    assert code == 1, out
    assert "FAULT" in out and "superseded" not in out, out
