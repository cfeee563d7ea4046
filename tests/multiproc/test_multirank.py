"""Multi-rank saves and restores with real processes, gloo, writer processes, SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from incluster.testing import FaultInjector
from incluster.testing.launch import launch

pytestmark = pytest.mark.multiproc

SCRIPT = os.path.join(os.path.dirname(__file__), "trainer_script.py")


THREAD_ENV = {"WRITER": "thread"}


def _run(base, attempt, *, nodes, rpn=1, steps=4, every=2, env=None, rank_env=None, timeout=120):
    out = os.path.join(base, "out")
    os.makedirs(out, exist_ok=True)
    e = {"ATTEMPT": str(attempt), "TIMEOUT_S": "20", **(env or {})}
    job = launch([SCRIPT, out, str(steps), str(every)], nodes=nodes, ranks_per_node=rpn, base_dir=base, env=e, rank_env=rank_env)
    codes = job.wait(timeout)
    results = {}
    for r in range(len(nodes) * rpn):
        path = os.path.join(out, f"result-r{r}-{attempt}.json")
        results[r] = json.load(open(path)) if os.path.exists(path) else None
    return codes, results, job


def _assert_restored(results, first, step):
    for r, res in results.items():
        assert res["loaded"] == step, (r, res["loaded"])
        assert res["loaded_digest"] == first[r]["digests"][str(step)], f"rank {r} restored state differs from step {step}"


def test_two_ranks_save_and_restore_bitwise_with_writer_processes(local_dir):
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"])
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    assert all(r["errors"] == {} and r["writer_pid"] for r in first.values())
    assert first[0]["node"] == "n0" and first[1]["node"] == "n1"
    assert sorted(os.listdir(os.path.join(local_dir, "n1", "mp", "rank-00001")))[-1] == "step-000000000004.safetensors"
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], steps=6)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 4)


def test_a_first_writer_that_dies_starting_is_started_again_and_its_partner_pairs_with_the_new_one(local_dir):
    """Rank 1's first writer fails to start (the Checkpointer starts it without waiting);
    its trainer starts another. Rank 0's first writer must pair with that one, not wait
    out slot_timeout_s for the dead one's rendezvous and fail the first step everywhere."""
    fault = FaultInjector().fail_at(rank=1, step=0, phase="writer-start").env()  # step: the incarnation
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], rank_env={1: fault})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    assert "could not start" in job.output(1) and "new writer" in job.output(1), job.output(1)
    assert first[0]["errors"] == {} and first[1]["errors"] == {}, (first[0]["errors"], first[1]["errors"])
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], steps=6)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 4)


def test_four_ranks_on_two_nodes_thread_writer(local_dir):
    nodes = ["a", "b"]
    codes, first, job = _run(local_dir, 0, nodes=nodes, rpn=2, env={"WRITER": "thread"})
    assert codes == [0] * 4, [job.output(r) for r in range(4)]
    # node b keeps its own ranks' shards and the replicas of node a's ranks (and vice versa)
    names = sorted(os.listdir(os.path.join(local_dir, "b", "mp")))
    assert [n for n in names if not n.startswith(".")] == [f"rank-0000{r}" for r in range(4)]
    # its own ranks' reserves, claims and node records
    assert [n for n in names if n.startswith(".")] == [".claim-00002", ".claim-00003", ".node-00002", ".node-00003",
                                                       ".reserve-00002", ".reserve-00003"]
    for node, owners in (("b", (0, 1)), ("a", (2, 3))):
        for owner in owners:
            sc = json.load(open(os.path.join(local_dir, node, "mp", f"rank-0000{owner}", "step-000000000004.json")))
            assert sc["rank"] == owner and sc["extra"]["replica_on"] == node
    codes, second, job = _run(local_dir, 1, nodes=nodes, rpn=2, env={"WRITER": "thread"}, steps=4)
    assert codes == [0] * 4
    _assert_restored(second, first, 4)


def test_one_ranks_writer_failing_fails_the_step_on_every_rank(local_dir):
    fault = FaultInjector().fail_at(rank=1, step=4, phase="commit", action="raise").env()
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], rank_env={1: fault})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    for r in (0, 1):
        kind, msg = first[r]["errors"]["4"]
        assert kind == "CommitError" and "rank 1" in msg, (r, msg)
        assert "2" not in first[r]["errors"]
    # no rank keeps a copy of step 4 that could be mistaken for a complete step
    assert not os.path.exists(os.path.join(local_dir, "n0", "mp", "rank-00000", "step-000000000004.json"))
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], steps=4)
    assert codes == [0, 0]
    _assert_restored(second, first, 2)


def test_one_failed_step_does_not_fail_every_later_one_when_nobody_waits(local_dir):
    """The README's loop (handles never waited, save() errors caught): rank 1's failed
    commit of step 2 reaches rank 1 at its next save() (which then saves nothing), but not
    rank 0's - else rank 0's next step would fail too, which rank 1 would raise at ITS
    next save(), and so on, no step saved again. Here step 2 and one later step are lost."""
    fault = FaultInjector().fail_at(rank=1, step=2, phase="commit", action="raise").env()
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], steps=12, every=2,
                             env={"NOWAIT": "1", **THREAD_ENV}, rank_env={1: fault})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    own = [v for k, v in first[1]["errors"].items() if k != "close"]  # its own step 2's failure, raised once
    assert len(own) == 1 and own[0][0] == "CommitError" and "step 2" in own[0][1], first[1]["errors"]
    # a peer's failure: logged, for wait() and the handle; superseded once a later step is
    # durable, so not raised hours later by close() either
    assert first[0]["errors"] == {}, first[0]["errors"]
    assert "step 2 failed on rank 1" in job.output(0)
    for r in (0, 1):
        # rank 1 raises its own failure at whichever later save() first finds it: that one
        # step goes too, every later one is saved
        assert first[r]["durable"][-2:] == [10, 12] and len(first[r]["durable"]) >= 3, (r, first[r]["durable"])


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_save_one_rank_skipped_fails_at_once_and_later_ones_land(local_dir, writer):
    """Only rank 0 saves step 4 (every rank must save the same steps). That step fails at
    once, saying so (writer/sequence.py), and every later save replicates and becomes
    durable. Once, rank 0's replica exchange of step 4 waited for rank 1 until it timed
    out, which closed their gloo pair for good: every later save failed with "pair
    closure"; then the pair was built again, but steps 4 to 8 still failed."""
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], steps=12, every=2,
                             env={"WRITER": writer, "TIMEOUT_S": "20"}, rank_env={1: {"SKIP_SAVES": "4"}},
                             timeout=180)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    errs = {k: v for k, v in first[0]["errors"].items() if k != "close"}
    assert list(errs) == ["4"] and "every rank must save the same steps" in errs["4"][1], errs
    assert first[1]["errors"] == {}, first[1]["errors"]
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], steps=12, env={"WRITER": writer})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 12)


def test_load_says_which_ranks_it_waits_for(local_dir):
    """load() is collective; a rank that has not called it after a while is named (a rank
    calling it alone used to wait in gloo for 30 min, silently). A late rank still joins."""
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], steps=2, env={"ARRIVAL_WARN_S": "1"},
                             rank_env={1: {"LOAD_DELAY_S": "4"}})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    assert "rank 0 has waited 1 s in load() for rank(s) 1, which have not called it" in job.output(0)
    assert "has waited" not in job.output(1)  # everyone was there when it came
    assert first[0]["errors"] == {} and first[1]["errors"] == {}


def test_writer_killed_mid_commit(local_dir):
    fault = FaultInjector().fail_at(rank=1, step=4, phase="commit", action="kill").env()
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], rank_env={1: fault})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    kind, msg = first[1]["errors"]["4"]
    assert kind == "WriterProcessDied" and "SIGKILL" in msg and str(first[1]["writer_pid"]) in msg
    kind, msg = first[0]["errors"]["4"]
    # rank 0 hears of it first-hand (rank 1's trainer publishes the death) or through its
    # replica exchange with rank 1 breaking; either way the step fails, with no hang
    assert kind == "CommitError" and ("rank 1" in msg or "replication" in msg), msg
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], steps=4)
    assert codes == [0, 0]
    _assert_restored(second, first, 2)


def test_a_step_a_writer_counted_before_it_died_stays_durable_on_every_rank(local_dir):
    """Rank 1's writer commits step 4 last, its count completes the step on every rank,
    and it is SIGKILLed before telling its trainer. Rank 0 holds step 4 as durable, so
    rank 1 must too: it used to un-commit its copy, so the newest step lacked rank 1 and
    a restart went back to step 2 (with keep=1, to nothing)."""
    fault = (FaultInjector().fail_at(rank=1, step=4, phase="commit", action="slow", seconds=2)
             .fail_at(rank=1, step=4, phase="counted", action="kill").env())
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], env={"REPLICAS": "0"}, rank_env={1: fault})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    assert first[0]["errors"] == {} and first[1]["errors"] == {}, (first[0]["errors"], first[1]["errors"])
    # the writer did die (its replacement starts in the background, maybe after this
    # short run's close(): not asserted)
    assert "the writer died after committing step 4; the step is durable" in job.output(1)
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], steps=4, env={"REPLICAS": "0"})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 4)


def test_a_killed_writer_is_replaced_and_replication_pairs_again(local_dir):
    """Rank 1's writer is SIGKILLed inside step 4's commit. A new writer takes over; both
    ranks pair their replication again; later steps are durable everywhere, with the
    replica of rank 1 on rank 0's node, so losing node n1 afterwards still restores."""
    fault = FaultInjector().fail_at(rank=1, step=4, phase="commit", action="kill").env()
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], steps=10, rank_env={1: fault})
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    for r in (0, 1):
        failed = set(first[r]["errors"])
        # step 4 is lost; step 6 too if rank 0 exchanged it before the new writer was up
        assert "4" in failed and failed <= {"4", "6"}, (r, first[r]["errors"])
    replica = os.path.join(local_dir, "n0", "mp", "rank-00001", "step-000000000010.json")
    assert json.load(open(replica))["extra"]["replica_on"] == "n0"
    shutil.rmtree(os.path.join(local_dir, "n1"))
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n2"], steps=10)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 10)
    assert second[1]["restore"]["source"] == "peer"


def test_trainer_killed_mid_save_no_rank_hangs(local_dir):
    fault = FaultInjector().fail_at(rank=1, step=4, phase="stage", action="kill").env()
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], rank_env={1: fault}, env={"TIMEOUT_S": "6"})
    assert codes[1] == -signal.SIGKILL
    assert codes[0] == 0, job.output(0)
    kind, msg = first[0]["errors"]["4"]
    # rank 0 learns within its timeout: its replica exchange with rank 1 times out (or,
    # without replication, the commit count stays at 1 of 2)
    assert (kind == "CommitError" and "replication" in msg) or (kind == "PeerTimeoutError" and "1 of 2" in msg), msg
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], steps=4)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    _assert_restored(second, first, 2)


def _as_if_rank_1_never_committed(base: str) -> None:
    """Every step loses rank 1's shard: its own copies on n1 go back to staging slots (a
    crash before its commit), its replicas on n0 never arrived."""
    for node in ("n0", "n1"):
        folder = os.path.join(base, node, "mp", "rank-00001")
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.endswith(".json"):
                os.unlink(path)
            elif name.endswith(".safetensors"):
                if node == "n1":
                    os.replace(path, os.path.join(folder, f".staging-{len(os.listdir(folder))}"))
                else:
                    os.unlink(path)


@pytest.mark.parametrize("how", ["crash-in-first-save", "node-lost", "copy-set-aside"])
def test_a_crash_before_any_step_was_complete_starts_afresh_but_a_lost_node_is_not_passed_over(local_dir, how):
    """A crash in a job's first save left rank 0's copy of step N and rank 1's slot, never
    committed: no step was ever durable. Every restart raised "step N lacks rank(s) [1]",
    so the job could never start again on its own. Where rank 1's node no longer holds its
    folder (lost, replaced), its shards may have been lost with it, and where its copies
    were committed and then found bad (records set aside), steps were durable: refused."""
    codes, first, job = _run(local_dir, 0, nodes=["n0", "n1"], env=THREAD_ENV)
    assert codes == [0, 0], [job.output(r) for r in range(2)]
    if how == "copy-set-aside":  # as a restart that found rank 1's copies bad leaves them
        own, replicas = (os.path.join(local_dir, n, "mp", "rank-00001") for n in ("n1", "n0"))
        for name in os.listdir(own):
            if name.endswith(".json"):
                os.replace(os.path.join(own, name), os.path.join(own, name + ".bad"))
        shutil.rmtree(replicas)
    else:
        _as_if_rank_1_never_committed(local_dir)
    if how == "node-lost":
        shutil.rmtree(os.path.join(local_dir, "n1", "mp", "rank-00001"))
    codes, second, job = _run(local_dir, 1, nodes=["n0", "n1"], env=THREAD_ENV)
    if how == "crash-in-first-save":
        assert codes == [0, 0], [job.output(r)[-2000:] for r in range(2)]
        assert second[0]["loaded"] is None and second[1]["loaded"] is None, second
        assert "no step of job 'mp' was ever complete" in job.output(0), job.output(0)[-2000:]
        # the new run saves those step numbers again: rank 0's never-complete copies of them are gone
        # (it refused them as "not newer than step 4", and rank 1 waited slot_timeout_s for its shard)
        assert second[0]["errors"] == {} and second[1]["errors"] == {}, second
    else:
        assert codes == [3, 3], codes  # load() raised
        assert all(res["load_error"][0] == "NoCheckpointError" and "rank(s) [1]" in res["load_error"][1]
                   for res in second.values()), second
