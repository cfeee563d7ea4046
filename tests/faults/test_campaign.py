"""The seeded crash campaign (small by default; ``pytest tests/faults --campaign 42`` for more).

Each trial: a 4-rank job on simulated nodes, one fault, a restart, a judged restore. The
judge's rules are tested first, on hand-made logs, so a broken judge cannot pass a run.
"""

from __future__ import annotations

import json
import os

import pytest

from incluster.testing import campaign, judge

# Two kinds by default (the others have tests of their own: a writer killed mid-commit or
# mid-replication in tests/multiproc/test_multirank.py, a corrupt replica in test_recovery.py);
# `make reliability` runs all 18 kinds, three trials each.
SMALL = ["kill-random", "kill-during-restore"]


def _log(out, rank, run, *events):
    with open(os.path.join(out, f"r{rank}-run{run}.jsonl"), "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def test_newest_complete_needs_a_good_copy_of_every_rank():
    copies = {(0, 4, "A/rank-00000/x"), (1, 4, "B/rank-00001/x"), (1, 4, "A/rank-00001/x"),
              (0, 2, "A/rank-00000/y"), (1, 2, "B/rank-00001/y"), (0, 6, "A/rank-00000/z")}
    assert judge.newest_complete(copies, 2) == 4
    assert judge.newest_complete(copies, 2, {"B/rank-00001/x"}) == 4  # the replica on A remains
    assert judge.newest_complete(copies, 2, {"B/rank-00001/x", "A/rank-00001/x"}) == 2
    assert judge.newest_complete(copies, 3) is None


def test_the_judge_catches_torn_lost_and_mixed_restores(tmp_path):
    out = str(tmp_path)
    for r in (0, 1):
        _log(out, r, 1, {"event": "saving", "step": 2, "digest": f"a{r}"}, {"event": "saving", "step": 4, "digest": f"b{r}"})
    digests = judge.saved_digests(out, 2, [1])
    cases = {
        2: ([("loaded", 4, "b0"), ("loaded", 4, "b1")], 4, "correct"),
        3: ([("loaded", 4, "b0"), ("loaded", 4, "XX")], 4, "torn"),  # bytes differ from the save
        4: ([("loaded", 2, "a0"), ("loaded", 2, "a1")], 4, "lost"),  # an older step though 4 was complete
        5: ([("loaded", 4, "b0"), ("loaded", 2, "a1")], 4, "torn"),  # ranks disagree
        6: ([("loaded", 4, "b0"), ("loaded", 4, "b1")], 2, "torn"),  # newer than anything complete
        7: ([("loaded", None, "-"), ("loaded", None, "-")], 2, "lost"),  # started afresh
        8: ([("load_error", None, "-"), ("load_error", None, "-")], None, "correct"),  # nothing to restore
    }
    for run, (loads, expected, want) in cases.items():
        for r, (ev, step, dg) in enumerate(loads):
            _log(out, r, run, {"event": ev, "step": step, "digest": dg, "kind": "NoCheckpointError", "message": "x"})
        v = judge.judge_restore(out, 2, run, expected, digests)
        got = "correct" if v.correct else "torn" if v.torn else "lost"
        assert got == want, (run, v)


def _trials(config):
    n = config.getoption("--campaign")
    if n:
        return campaign.plan(n, config.getoption("--campaign-seed"))
    return [campaign.Trial(i, kind, 7 + i) for i, kind in enumerate(SMALL)]


def pytest_generate_tests(metafunc):
    if "trial" in metafunc.fixturenames:
        trials = _trials(metafunc.config)
        metafunc.parametrize("trial", trials, ids=[f"{t.index}-{t.kind}" for t in trials])


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_trial(trial, local_dir):
    r = campaign.run_trial(trial, local_dir)
    v = r.verdict
    assert not r.hang, f"{trial.describe()}: a process outlived its deadline ({r.fault}; {r.restart})"
    assert v is not None and v.correct, f"{trial.describe()}: {r.fault}; {r.restart}; {v}"
    assert not r.checks, r.checks
