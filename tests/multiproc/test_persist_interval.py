"""``persistent_interval_s``: every rank agrees which saves persist, the first always does,
and no rank's commit waits for rank 0's decision (rank 0's commit may be slow); close()
catches the tier up on every rank; ranks that disagree on ``persist=`` are told at once."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.faults import FaultInjector
from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "persist_interval_script.py")
SLOW_S = 6.0


def test_time_based_persistent_saves_do_not_tie_writers_to_rank_0(local_dir):
    out, persist = os.path.join(local_dir, "out"), os.path.join(local_dir, "persist")
    os.makedirs(out)
    slow = FaultInjector().fail_at(phase="commit", rank=0, step=3, action="slow", seconds=SLOW_S).env()
    job = launch([SCRIPT, out, persist], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir, env=slow)
    codes = job.wait(150)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    res = [json.load(open(os.path.join(out, f"result-r{r}.json"))) for r in range(2)]
    assert res[0]["persisted"] == res[1]["persisted"], res
    persisted = res[0]["persisted"]
    assert persisted[0] == 1 and 1 < len(persisted) < 6, res  # the first, then about once a second
    manifests = sorted(n for n in os.listdir(os.path.join(persist, "interval")) if n.startswith("step-"))
    assert manifests and all(os.path.exists(os.path.join(persist, "interval", n, "COMMITTED.json")) for n in manifests)
    # Rank 1 commits step 4 while rank 0 is still in its slow commit of step 3.
    assert res[1]["local4_s"] < SLOW_S / 2, res[1]


CATCH_UP = os.path.join(os.path.dirname(__file__), "close_catch_up_script.py")


def test_close_uploads_the_newest_step_on_every_rank_when_due_uploads_were_skipped(local_dir):
    out, persist = os.path.join(local_dir, "out"), os.path.join(local_dir, "persist")
    os.makedirs(out)
    job = launch([CATCH_UP, out, persist], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir)
    codes = job.wait(150)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    res = [json.load(open(os.path.join(out, f"result-r{r}.json"))) for r in range(2)]
    assert res[0]["persisted"] == res[1]["persisted"] == [0], res  # 2 and 4 came while 0 uploaded
    manifest = json.load(open(os.path.join(persist, "catch", "step-000000000005", "COMMITTED.json")))
    assert sorted(r["rank"] for r in manifest["ranks"]) == [0, 1]


DISAGREE = os.path.join(os.path.dirname(__file__), "persist_disagree_script.py")


@pytest.mark.parametrize("every", [100, 1], ids=["not-due-elsewhere", "due-anyway"])
def test_ranks_that_disagree_on_persist_are_told_at_once_not_after_slot_timeout_s(local_dir, every):
    """Rank 0 passes persist=True, rank 1 not: rank 1 uploads nothing, and rank 0's upload
    waited slot_timeout_s for its shard, then close() as long again, with no word of why.
    Where the step is due anyway, rank 1 uploads it too, and it lands."""
    out, persist = os.path.join(local_dir, "out"), os.path.join(local_dir, "persist")
    os.makedirs(out)
    job = launch([DISAGREE, out, persist], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir,
                 env={"EVERY": str(every)})
    codes = job.wait(150)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    r0, r1 = (json.load(open(os.path.join(out, f"result-r{r}.json"))) for r in range(2))
    assert r0["persisted_s"] < 20 and r0["close_s"] < 20, r0  # slot_timeout_s is 60
    manifest = os.path.join(persist, "disagree", "step-000000000002", "COMMITTED.json")
    if every == 1:
        assert r0.get("persisted") is True and r1.get("persisted") is True, (r0, r1)
        assert os.path.exists(manifest)
        return
    assert "only 1 of 2 ranks upload step 2" in r0.get("error", ""), r0
    said = "rank 0: save(2, persist=True): only 1 of 2 ranks upload step 2"  # in the log: no one reads persisted
    assert said in job.output(0) and "step 2 is not in the persistent tier" in job.output(0), job.output(0)[-2000:]
    assert r1 == {"persisted": False, "persisted_s": r1["persisted_s"], "close_s": r1["close_s"]}, r1
    assert not os.path.exists(manifest)
