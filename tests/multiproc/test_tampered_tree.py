"""A sidecar that still parses but whose state tree names a tensor its shard lacks (one
flipped byte in a name) is a bad copy like any other: the restore sets it aside and uses
the replica on another node, on every rank together; before, that rank raised and the
others waited for it until the process-group timeout."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "full_heal_script.py")


def _rename_tensor_reference(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    assert raw.count('"T": "w"') == 1 or raw.count('"T":"w"') == 1, raw[:400]
    tampered = raw.replace('"T": "w"', '"T": "x"').replace('"T":"w"', '"T":"x"')
    with open(path, "w", encoding="utf-8") as f:
        f.write(tampered)


def test_a_sidecar_naming_a_missing_tensor_is_set_aside_and_the_replica_used(local_dir):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out, "save"], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    assert job.wait(120) == [0, 0], [job.output(r) for r in range(2)]
    _rename_tensor_reference(os.path.join(local_dir, "n0", "fullheal", "rank-00000", "step-000000000002.json"))
    job = launch([SCRIPT, out, "load"], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(120)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    res = [json.load(open(os.path.join(out, f"result-load-r{r}.json"))) for r in range(2)]
    assert res[0] == {"loaded": 2, "equal": True, "source": "peer", "step3": "durable"}, res
    assert res[1]["loaded"] == 2 and res[1]["equal"], res
