"""Every rank must save the same steps. A rank that skips one, or saves one more, fails
that step on every rank at once, with an error saying which rank and which steps; the
others do not wait slot_timeout_s for it, and the next common step is durable."""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc
SCRIPT = os.path.join(os.path.dirname(__file__), "skipped_save_script.py")


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_step_not_every_rank_saves_fails_at_once_and_the_next_lands(local_dir, writer):
    out = os.path.join(local_dir, "out")
    os.makedirs(out)
    job = launch([SCRIPT, out], nodes=["n0", "n1"], ranks_per_node=1, base_dir=local_dir, env={"WRITER": writer})
    codes = job.wait(170)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    r0, r1 = (json.load(open(os.path.join(out, f"result-r{r}.json"))) for r in range(2))
    for res in (r0, r1):
        assert [res[s] for s in ("2", "6", "8", "12", "14", "16", "20", "24")] == ["durable"] * 8, (r0, r1)
    # The steps only one rank saved failed there, naming the mismatch, whichever rank's
    # writer reached the job store first (the skipper: "rank 1 did not save step 4"; the
    # one that saved it: "rank 1 saved step 6, not step 4"): rank 0's error names rank 1.
    for res, step in ((r0, "4"), (r1, "7"), (r0, "9"), (r0, "10"), (r1, "11")):
        assert res[step] != "durable" and "every rank must save the same steps" in res[step], (step, res)
    assert "rank 1 did not save step 4" in r0["4"] or "rank 1 saved step 6, not step 4" in r0["4"], r0
    # No step waited for slot_timeout_s (60 s): three mismatches in all, in seconds.
    assert r0["elapsed_s"] < 30 and r1["elapsed_s"] < 30, (r0["elapsed_s"], r1["elapsed_s"])
    # Every 2nd save goes to the persistent tier. The ranks made 7 and 5 save() calls before
    # step 14: numbered by their own calls, each would upload the other's off step and no
    # step would ever be whole there. Numbered along the job's sequence of saves, both
    # upload the same one of 14 and 16, and it is complete in the tier.
    assert r0["persisted14"] == r1["persisted14"] and r0["persisted16"] == r1["persisted16"], (r0, r1)
    assert r0["persisted14"] != r0["persisted16"], r0
    # A refused save is published behind the staging of the save before it: had rank 0's
    # writer heard of 22 before its commit of 20, it would have taken 20 for a step it
    # skipped and failed it on every rank.
    assert r0["22"].startswith("refused: ") and "save() raised on rank 0" in r1["22"], (r0, r1)
    # The last save one rank skips before close(): it failed on a closed gloo pair,
    # blaming the rank that saved it, and "a remote worker crashing".
    assert "rank 1 closed its Checkpointer after step 24 and saves no more: step 26 is not saved" in r0["26"], r0["26"]
