"""The single-process Checkpointer: futures, slot reuse, commits, restores, failures."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time

import pytest
import torch

import incluster
from incluster.staging.slots import sidecar_file, step_file

from helpers import assert_bitwise, clone_state, tiny_model, train


def _ckpt(local_dir, **kw):
    kw.setdefault("writer", "thread")  # the process writer has tests of its own
    return incluster.Checkpointer(local_dir=local_dir, job=kw.pop("job", "t"), **kw)


def test_round_trip_of_model_and_adamw_after_steps(local_dir):
    m, o = tiny_model(0), None
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, o, 3)
    with _ckpt(local_dir) as ck:
        h = ck.save(3, {"model": m, "optim": o, "extra": {"tokens": 96}})
        h.wait()
        assert h.staged.done() and h.durable.done()
        assert h.blocked_s >= 0 and 0 <= h.staged_s <= h.committed_s <= h.durable_s
        assert h.drained_s is None  # only a GPU save the writer process drains has one
    ref = clone_state(m, o)
    m2 = tiny_model(5)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    state2 = {"model": m2, "optim": o2, "extra": {"tokens": 0}}
    with _ckpt(local_dir) as ck:
        assert ck.load(state2) == 3
    assert_bitwise(m2, o2, ref)
    assert state2["extra"] == {"tokens": 96}


def test_load_with_nothing_saved_returns_none(local_dir):
    with _ckpt(local_dir) as ck:
        assert ck.load({"model": tiny_model()}) is None


def test_each_save_holds_the_values_of_its_own_step(local_dir):
    """Cached layouts must never re-save old bytes (the structure-cache bug class)."""
    w = torch.zeros(1000)
    with _ckpt(local_dir, keep=3) as ck:
        for step in range(1, 6):
            w.fill_(step)
            ck.save(step, {"w": w}).wait()
            target = {"w": torch.empty(1000)}
        # keep=3: steps 3, 4, 5 remain; each must hold its own values
        for step in (5,):
            assert ck.load(target) == step
            assert torch.equal(target["w"], torch.full((1000,), float(step)))
    from incluster.tiers.local import ShardReader

    for step in (3, 4, 5):
        with ShardReader(os.path.join(local_dir, "t", "rank-00000"), step) as r:
            assert torch.equal(r.tensor("w"), torch.full((1000,), float(step)))


def test_slots_are_reused_same_inode_same_mapping(local_dir):
    w = torch.randn(4096)
    with _ckpt(local_dir, keep=2) as ck:
        seen = {}
        for step in range(6):
            w.add_(1)
            ck.save(step, {"w": w}).wait()
            path = os.path.join(ck.folder, step_file(step))
            slot = next(s for s in ck.ring.slots if s.step == step)
            seen.setdefault(slot.index, set()).add((os.stat(path).st_ino, id(slot.mm), slot.maps))
        assert len(ck.ring.slots) == 2
        for index, variants in seen.items():
            assert len(variants) == 1, f"slot {index} was re-created or remapped: {variants}"
        files = sorted(os.listdir(ck.folder))
    assert files == [sidecar_file(4), step_file(4), sidecar_file(5), step_file(5)]


def test_structure_change_gets_a_new_layout_and_loads_correctly(local_dir):
    with _ckpt(local_dir) as ck:
        ck.save(1, {"a": torch.ones(10)}).wait()
        ck.save(2, {"a": torch.ones(10), "b": torch.full((3, 3), 2.0)}).wait()
        ck.save(3, {"a": torch.ones(20) * 3}).wait()
        assert ck._stager.layouts.misses == 3
        target = {"a": torch.zeros(20)}
        assert ck.load(target) == 3
        assert torch.equal(target["a"], torch.ones(20) * 3)


def test_newest_committed_step_is_never_overwritten_while_a_save_is_pending(local_dir):
    with _ckpt(local_dir, keep=2) as ck:
        ck.save(1, {"w": torch.ones(8)}).wait()
        ck.save(2, {"w": torch.ones(8) * 2}).wait()
        ck.save(3, {"w": torch.ones(8) * 3})  # takes the slot of step 1, never step 2's
        assert os.path.exists(os.path.join(ck.folder, sidecar_file(2)))
        ck.wait()


def test_steps_must_increase(local_dir):
    with _ckpt(local_dir) as ck:
        ck.save(5, {"w": torch.ones(2)}).wait()
        with pytest.raises(incluster.CheckpointError, match="must increase"):
            ck.save(5, {"w": torch.ones(2)})


@pytest.fixture
def late_staging(monkeypatch):
    """Staging starts 0.3 s late: a step that did not wait would land in the copy."""
    from incluster.staging.engine import Stager

    run = Stager.run

    def late(self, job):
        time.sleep(0.3)
        return run(self, job)

    monkeypatch.setattr(Stager, "run", late)


def test_optimizer_pre_step_hook_waits_for_staging(local_dir, late_staging):
    m = tiny_model()
    o = torch.optim.SGD(m.parameters(), lr=0.5)
    train(m, o, 1)
    with _ckpt(local_dir) as ck:
        before = {k: v.clone() for k, v in m.state_dict().items()}
        h = ck.save(1, {"model": m, "optim": o})
        assert not h.staged.done()
        train(m, o, 1)  # mutates parameters; the hook must have let staging finish first
        assert h.staged.done()
        h.wait()
    target = tiny_model(9)
    with _ckpt(local_dir) as ck:
        ck.load({"model": target, "optim": torch.optim.SGD(target.parameters(), lr=0.5)})
    for k, v in target.state_dict().items():  # buffers too: cloned at save(), before train()'s forward
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("keyword", [False, True])
def test_step_with_a_closure_overlaps_its_forward_and_waits_before_the_update(local_dir, late_staging, keyword):
    m = tiny_model()
    o = torch.optim.SGD(m.parameters(), lr=0.5)
    train(m, o, 1)
    seen = {}
    with _ckpt(local_dir) as ck:
        saved = {k: v.clone() for k, v in m.state_dict().items()}
        h = ck.save(1, {"model": m, "optim": o})

        def closure():
            seen["staged_at_forward"] = h.staged.done()
            o.zero_grad()
            loss = m(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            return loss

        o.step(closure=closure) if keyword else o.step(closure)  # the way Lightning and LBFGS step
        assert seen["staged_at_forward"] is False  # the forward/backward ran while staging
        assert h.staged.done()  # ... and the update waited for it
        assert not torch.equal(m[0].weight, saved["0.weight"])
        h.wait()
    target = tiny_model(9)
    with _ckpt(local_dir) as ck:
        ck.load({"model": target, "optim": torch.optim.SGD(target.parameters(), lr=0.5)})
    for k, v in target.state_dict().items():
        if "running" not in k and "num_batches" not in k:  # buffers: changed by the closure's forward
            assert torch.equal(v, saved[k]), k


def test_batchnorm_buffers_are_captured_when_save_is_called(local_dir):
    m = tiny_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    train(m, o, 1)
    with _ckpt(local_dir) as ck:
        before = m[1].running_mean.clone()
        h = ck.save(1, {"model": m})
        m(torch.randn(8, 16) * 100)  # forward right after save(): updates running stats
        h.wait()
        target = tiny_model(3)
        ck.load({"model": target})
    assert torch.equal(target[1].running_mean, before)


def test_save_killed_before_sidecar_leaves_previous_step_loadable(local_dir, monkeypatch):
    """A crash between staging and the sidecar: the step does not exist, the older one loads."""
    import incluster.writer.local_commit as lc

    w = torch.arange(64.0)
    with _ckpt(local_dir) as ck:
        ck.save(1, {"w": w}).wait()

        def crash(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(lc, "write_sidecar", crash)
        h = ck.save(2, {"w": w + 1})
        with pytest.raises(incluster.CommitError, match="No space left"):
            h.wait()
        monkeypatch.undo()
        assert not os.path.exists(os.path.join(ck.folder, sidecar_file(2)))
        target = {"w": torch.zeros(64)}
        assert ck.load(target) == 1
        assert torch.equal(target["w"], w)
        ck.save(3, {"w": w + 3}).wait()  # training goes on; the slot was released
        assert ck.load(target) == 3 and torch.equal(target["w"], w + 3)


def test_corrupt_newest_step_falls_back_to_older_with_a_warning(local_dir, caplog):
    with _ckpt(local_dir) as ck:
        ck.save(1, {"w": torch.ones(100)}).wait()
        ck.save(2, {"w": torch.ones(100) * 2}).wait()
        folder = ck.folder
    path = os.path.join(folder, step_file(2))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    target = {"w": torch.zeros(100)}
    with caplog.at_level(logging.WARNING, logger="incluster"), _ckpt(local_dir) as ck:
        assert ck.load(target) == 1
        assert torch.equal(target["w"], torch.ones(100))
        assert "checksum mismatch" in caplog.text and "step 2" in caplog.text
        # the step restored instead is said too, with the step it is not
        assert "restored step 1, not the newer step 2" in caplog.text, caplog.text
        ck.save(2, {"w": torch.ones(100) * 5}).wait()  # the corrupt step was discarded


def test_jobs_are_isolated_and_files_private(local_dir):
    with _ckpt(local_dir, job="a") as a, _ckpt(local_dir, job="b") as b:
        a.save(1, {"w": torch.ones(4)}).wait()
        assert b.load({"w": torch.zeros(4)}) is None
        assert stat.S_IMODE(os.stat(a.folder).st_mode) == 0o700
        for name in os.listdir(a.folder):
            assert stat.S_IMODE(os.stat(os.path.join(a.folder, name)).st_mode) == 0o600, name


def test_rejected_state_fails_in_save_itself(local_dir):
    with _ckpt(local_dir) as ck, pytest.raises(incluster.CheckpointError, match="extra/fn"):
        ck.save(1, {"extra": {"fn": lambda: 0}})


@pytest.mark.parametrize("bad,fix", [
    (lambda: torch.eye(3).to_sparse(), r"extra/t: a torch.sparse_coo tensor cannot be stored.*to_dense"),
    (lambda: torch.empty(3, device="meta"), r"extra/t: a tensor on the meta device holds no values.*to_empty"),
])
def test_tensors_without_dense_values_are_refused_by_path_with_the_fix(local_dir, bad, fix):
    with _ckpt(local_dir) as ck:
        with pytest.raises(incluster.CheckpointError, match=fix):
            ck.save(1, {"extra": {"t": bad()}})
        ck.save(2, {"extra": {"t": torch.ones(3)}}).wait()  # and the Checkpointer goes on


def test_bad_options_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="keep"):
        incluster.Checkpointer(local_dir="/tmp/x", keep=1)
    with pytest.raises(ValueError, match="keep must be at most 64"):  # it once tried to make 10**9 slots
        incluster.Checkpointer(local_dir="/tmp/x", keep=10**9)
    with pytest.raises(ValueError, match="keep"):
        incluster.Checkpointer(local_dir="/tmp/x", keep=True)
    with pytest.raises(ValueError, match="job"):
        incluster.Checkpointer(local_dir="/tmp/x", job="../evil")


def test_env_selects_local_dir_and_node(local_dir, monkeypatch):
    monkeypatch.setenv("INCLUSTER_LOCAL_DIR", local_dir)
    monkeypatch.setenv("INCLUSTER_NODE", "node-7")
    with incluster.Checkpointer(job="envjob") as ck:
        assert ck.folder.startswith(local_dir)
        assert ck.config.node == "node-7"


def test_closed_checkpointer_refuses_use(local_dir):
    ck = _ckpt(local_dir)
    ck.close()
    with pytest.raises(incluster.CheckpointError, match="closed"):
        ck.save(1, {"w": torch.ones(1)})


def test_goodput_events_are_recorded_when_a_run_dir_is_given(local_dir, tmp_path):
    import json

    run = tmp_path / "run"
    with _ckpt(local_dir, run_dir=run) as ck:
        ck.save(1, {"w": torch.ones(4)}).wait()
        ck.record_step(1)
        ck.load({"w": torch.zeros(4)})
    lines = [json.loads(x) for f in run.iterdir() for x in f.read_text().splitlines()]
    kinds = [e["kind"] for e in lines]
    for k in ("start", "save", "staged", "durable", "train_step", "load", "end"):
        assert k in kinds, k
    durable = next(e for e in lines if e["kind"] == "durable")
    assert durable["step"] == 1 and durable["tier"] == "local" and durable["seconds"] > 0


def test_many_tensors_over_both_copy_threads_land_exactly(local_dir):
    """Over 8 MiB of small tensors: the copies are split over two threads."""
    from incluster.tiers.local import ShardReader

    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(16384 + i, generator=g) for i in range(200)}
    state["half"] = torch.randn(1000, generator=g).half()
    state["strided"] = torch.randn(64, 64, generator=g).t()  # not contiguous: the copy_ path
    with _ckpt(local_dir) as ck:
        for step in (1, 2):
            for t in state.values():
                t.add_(1)
            ck.save(step, state).wait()
            with ShardReader(ck.folder, step) as r:
                for name, t in state.items():
                    assert torch.equal(r.tensor(name), t), (step, name)


def test_close_is_bounded_when_staging_is_stuck(local_dir, monkeypatch):
    from incluster.staging.engine import Stager

    run = Stager.run
    release = __import__("threading").Event()

    def stuck(self, job):  # a copy that does not come back (a hung device, a stopped disk)
        release.wait(20)
        return run(self, job)

    monkeypatch.setattr(Stager, "run", stuck)
    ck = _ckpt(local_dir, slot_timeout_s=1.0)
    ck.save(1, {"w": torch.ones(4)})
    t0 = time.monotonic()
    with pytest.raises(incluster.CheckpointError):
        ck.close()  # the save never became durable: said, not waited for without end
    assert time.monotonic() - t0 < 6
    release.set()


def test_close_from_a_finalizer_at_interpreter_exit(local_dir):
    """Frameworks close checkpointers from ``__del__``; at exit the thread pools are gone."""
    import subprocess
    import sys

    script = f"""
import builtins, torch, incluster
class Holder:
    def __init__(self, ck): self.ck = ck
    def __del__(self):
        self.ck.close(); print("closed at exit")
ck = incluster.Checkpointer(local_dir={local_dir!r}, job="atexit", writer="thread")
ck.save(1, {{"w": torch.ones(4)}}).wait()
builtins._held = Holder(ck)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "closed at exit" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-2000:]


_EXIT_WITHOUT_CLOSE = """
import sys, torch, incluster
torch.manual_seed(0)
m = torch.nn.Linear(1024, 1024); o = torch.optim.AdamW(m.parameters())
m(torch.randn(4, 1024)).sum().backward(); o.step()
c = incluster.Checkpointer(local_dir=sys.argv[1], job="noclose", writer=sys.argv[2])
c.save(7, {"model": m, "optim": o})
torch.save(m.state_dict(), sys.argv[3])
"""  # ends right after save(): no wait(), no close()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_script_that_ends_without_close_keeps_its_last_save(local_dir, tmp_path, writer):
    import subprocess
    import sys

    from incluster.testing import FaultInjector

    ref = str(tmp_path / "ref.pt")
    # the commit takes 2 s, so the save is surely still in flight when the script ends
    slow = FaultInjector().fail_at(phase="commit", step=7, action="slow", seconds=2.0).env()
    out = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, local_dir, writer, ref],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **slow})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exits without Checkpointer.close()" in out.stderr  # and says so
    m = torch.nn.Linear(1024, 1024)
    with incluster.Checkpointer(local_dir=local_dir, job="noclose", writer="thread") as ck:
        assert ck.load({"model": m}) == 7
    saved = torch.load(ref)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in saved.items())


def test_a_load_given_fewer_parts_than_were_saved_restores_those_and_names_the_rest(local_dir, caplog):
    caplog.set_level(logging.WARNING, logger="incluster")
    m = tiny_model()
    o = torch.optim.AdamW(m.parameters())
    train(m, o, 1)
    with incluster.Checkpointer(local_dir=local_dir, job="part", writer="thread") as ck:
        ck.save(3, {"model": m, "optim": o, "left_out_scheduler": {"epoch": 2}}).wait()
    m2 = tiny_model(seed=9)
    with incluster.Checkpointer(local_dir=local_dir, job="part", writer="thread") as ck:
        assert ck.load({"model": m2}) == 3  # a model-only load (evaluation) is allowed
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in m.state_dict().items())
    said = [r.getMessage() for r in caplog.records if "which this load() was not given" in r.getMessage()]
    assert len(said) == 1 and "['optim', 'left_out_scheduler']" in said[0], said


def test_a_misspelt_or_mistyped_option_is_refused_naming_the_fix(local_dir):
    with pytest.raises(TypeError, match=r"Checkpointer\(\) got an unknown option 'local_dirs'; did you mean 'local_dir'"):
        incluster.Checkpointer(local_dirs=local_dir)
    with pytest.raises(TypeError, match=r"local_dir must be a path \(str or os.PathLike\), not int"):
        incluster.Checkpointer(local_dir=123)
    with pytest.raises(ValueError, match="local_dir is an empty path"):  # not a silent default
        incluster.Checkpointer(local_dir="")
    with pytest.raises(TypeError, match=r"slot_timeout_s must be a number of seconds, not str '3'"):
        incluster.Checkpointer(local_dir=local_dir, slot_timeout_s="3")
    with pytest.raises(TypeError, match=r"persistent must be a path, a URL \(s3://bucket/prefix\) or an incluster Tier, not int 5"):
        incluster.Checkpointer(local_dir=local_dir, persistent=5)
    with pytest.raises(ValueError, match=r"persistent_every=3 and persistent_interval_s=1.0 each choose .*; pass one"):
        incluster.Checkpointer(local_dir=local_dir, persistent=local_dir + "-tier", persistent_every=3,
                               persistent_interval_s=1.0)  # before, persistent_every was ignored without a word


def test_a_mistyped_persistent_url_is_refused_not_written_to_a_local_folder(local_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(incluster.CheckpointError, match=r"'s3:/bkt/x': s3:/ has one slash.*write s3://bkt/x"):
        incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread", persistent="s3:/bkt/x")
    with pytest.raises(incluster.CheckpointError, match=r"fsspec knows no protocol 'S3'; write s3://"):
        incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread", persistent="S3://bkt/x")
    with pytest.raises(incluster.CheckpointError, match=r"fsspec knows no protocol 'foo'"):
        incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread", persistent="foo://bkt/x")
    assert not list(tmp_path.iterdir())  # nothing written under the working directory


def test_a_tilde_in_a_path_is_the_home_folder_not_a_folder_named_tilde(local_dir, tmp_path, monkeypatch):
    """``persistent="~/tier"`` wrote to ./~/tier: a relaunch from another folder found
    nothing there and started from scratch without a word."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread", persistent="~/tier",
                                persistent_every=1) as ck:
        assert ck.config.persistent == str(tmp_path / "home" / "tier")
        assert ck.save(1, {"w": torch.ones(2)}).persisted.result(60)
    assert (tmp_path / "home" / "tier" / "j").is_dir() and not (tmp_path / "~").exists()
    monkeypatch.setenv("HOME", os.path.dirname(local_dir))  # local_dir="~/<its name>" is local_dir itself
    with incluster.Checkpointer(local_dir=os.path.join("~", os.path.basename(local_dir)), job="j",
                                writer="thread") as ck:
        assert ck.config.local_dir == local_dir and ck.load({"w": torch.zeros(2)}) == 1


def test_a_local_dir_that_cannot_hold_folders_names_the_option_and_the_fix(local_dir, tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    caplog.set_level(logging.WARNING, logger="incluster")
    for bad in (tmp_path / "a-file", tmp_path / "a-file" / "below", "/proc/incluster-nope"):
        with pytest.raises(incluster.CheckpointError, match=r"cannot create this job's folder in local_dir .*"
                                                            r"point local_dir \(or INCLUSTER_LOCAL_DIR\)"):
            incluster.Checkpointer(local_dir=bad, job="j", writer="thread")
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no "not in RAM" advice first


def test_a_replica_asked_for_in_a_one_process_job_is_said_to_be_impossible(local_dir, caplog):
    caplog.set_level(logging.WARNING, logger="incluster")
    with incluster.Checkpointer(local_dir=local_dir, job="solo", writer="thread"):
        pass  # the default asks for nothing in particular: quiet
    assert not [r for r in caplog.records if "no other node" in r.getMessage()]
    with incluster.Checkpointer(local_dir=local_dir, job="solo", writer="thread", replicas=1):
        pass
    assert [r for r in caplog.records if "replicas=1 asked for, but this job is one process" in r.getMessage()]


def test_an_earlier_saves_error_raised_by_save_says_that_step_was_not_saved(local_dir, monkeypatch):
    """A loop that catches save()'s errors must learn that the step it asked for was not
    the one that failed, and was not saved; the next save goes on."""
    from incluster.testing import FaultInjector

    monkeypatch.setenv(*next(iter(FaultInjector().fail_at(phase="commit", step=2, action="raise").env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread") as ck:
        for step in (0, 1, 2):
            h = ck.save(step, {"w": torch.full((100,), float(step))})
            with contextlib.suppress(incluster.CheckpointError):
                h.durable.result(30)
        with pytest.raises(incluster.CommitError, match="step 2") as err:
            ck.save(3, {"w": torch.full((100,), 3.0)})
        assert any("step 3 is not saved" in n for n in getattr(err.value, "__notes__", []))
        ck.save(4, {"w": torch.full((100,), 4.0)}).wait()
    with incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread") as ck:
        assert ck.load({"w": torch.zeros(100)}) == 4


def test_several_earlier_failures_are_raised_by_one_save_and_the_next_save_goes_on(local_dir, monkeypatch):
    """Two saves failed in the background, unobserved: save() raised the first, and the
    save() after it the second, so two more steps went unsaved for one incident."""
    from incluster.testing import FaultInjector

    faults = FaultInjector().fail_at(phase="commit", step=1, action="slow", seconds=1.0)  # 2 is saved meanwhile
    faults.fail_at(phase="commit", step=1, action="raise").fail_at(phase="commit", step=2, action="raise")
    monkeypatch.setenv(*next(iter(faults.env().items())))
    with incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread", keep=3) as ck:
        ck.save(0, {"w": torch.zeros(100)}).wait()
        handles = [ck.save(step, {"w": torch.full((100,), float(step))}) for step in (1, 2)]
        for h in handles:
            with contextlib.suppress(incluster.CheckpointError):
                h.durable.result(30)
        with pytest.raises(incluster.CommitError, match="step 1") as err:
            ck.save(3, {"w": torch.full((100,), 3.0)})
        notes = getattr(err.value, "__notes__", [])
        assert any(n.startswith("1 later save(s) failed too") and "step 2: " in n for n in notes), notes
        ck.save(4, {"w": torch.full((100,), 4.0)}).wait()
        ck.wait()  # nothing left to raise
    with incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread") as ck:
        assert ck.load({"w": torch.zeros(100)}) == 4


def test_replicas_in_a_one_process_job_warns_without_advising_a_tier_it_has(local_dir, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="incluster"):
        incluster.Checkpointer(local_dir=local_dir, job="r1", writer="thread", replicas=1).close()
        incluster.Checkpointer(local_dir=local_dir, job="r2", writer="thread", replicas=1,
                               persistent=str(tmp_path / "p")).close()
    said = [r.getMessage() for r in caplog.records if "replicas=1 asked for" in r.getMessage()]
    assert len(said) == 2 and "add persistent=" in said[0], said
    assert "add persistent=" not in said[1] and "RAM and the persistent tier" in said[1], said


def test_saving_parameters_leaves_no_autograd_graph_that_keeps_them_alive(local_dir):
    """Parameters saved by reference (a plain dict of an optimizer's parameters, large
    enough to be copied by torch) must not tie the RAM-disk slot into their autograd
    graph: the graph would grow with every save and keep the parameters alive after
    the model is gone."""
    import gc
    import weakref

    with incluster.Checkpointer(local_dir=local_dir, job="g", writer="thread") as ck:
        w = torch.nn.Parameter(torch.randn(2100, 2100))  # 17 MiB: past the plain-memcpy size
        opt = torch.optim.SGD([w], lr=0.1)
        for step in range(3):
            w.grad = torch.ones_like(w)
            opt.step()
            ck.save(step, {"w": w, "opt": opt}).wait()
        gone = weakref.ref(w)
        del w, opt
        gc.collect()
        assert gone() is None


@pytest.mark.parametrize("swap", ["data", "half"])
def test_parameters_rebound_right_after_save_do_not_change_what_it_saves(local_dir, late_staging, swap):
    """Swapping weights in after save() returns (EMA weights for an evaluation through
    ``p.data``, ``model.half()`` for inference) rebinds the parameters; the checkpoint
    still holds what they were when save() was called."""
    m = tiny_model()
    o = torch.optim.SGD(m.parameters(), lr=0.5)
    train(m, o, 1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with _ckpt(local_dir) as ck:
        h = ck.save(1, {"model": m})
        if swap == "data":
            for p in m.parameters():
                p.data = torch.zeros_like(p)
        else:
            m.half()
        h.wait()
    fresh = tiny_model(5)
    with _ckpt(local_dir) as ck:
        assert ck.load({"model": fresh}) == 1
    for k, v in fresh.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


_WORKERS_AFTER_SAVE = """
import sys, time, torch, incluster
c = incluster.Checkpointer(local_dir=sys.argv[1], job="workers", writer="thread")
c.save(7, {"w": torch.ones(1024)})  # in flight: its commit takes 6 s
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), num_workers=2)
t0 = time.monotonic()
for _ in loader:
    pass
print(f"epoch took {time.monotonic() - t0:.2f} s")
c.close()
"""


def test_dataloader_workers_ending_do_not_run_the_trainers_exit_drain(local_dir):
    """A DataLoader's workers are forked children that run the interpreter's thread exit
    hooks when they end: they must not try to finish (or close) the trainer's saves,
    which held every epoch ~5 s per worker and warned of saves lost that were not."""
    import subprocess
    import sys

    from incluster.testing import FaultInjector

    slow = FaultInjector().fail_at(phase="commit", step=7, action="slow", seconds=6.0).env()
    out = subprocess.run([sys.executable, "-c", _WORKERS_AFTER_SAVE, local_dir], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **slow})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exits without Checkpointer.close()" not in out.stderr, out.stderr[-3000:]
    # a worker that drained would wait for that commit (or the drain's ~5 s bound)
    assert float(out.stdout.split("epoch took ")[1].split()[0]) < 4.0, out.stdout


def test_a_save_racing_a_close_on_another_thread_is_refused_as_closed(local_dir):
    """save() on one thread while close() runs on another raised torch's pool error
    ("cannot schedule new futures after shutdown") about half the time: a loop catching
    CheckpointError around save() crashed."""
    import threading

    for attempt in range(6):
        ck = incluster.Checkpointer(local_dir=local_dir, job=f"race{attempt}", writer="thread", keep=4)
        seen: list[BaseException] = []
        started = threading.Event()

        def saving() -> None:
            try:
                for step in range(1000):
                    ck.save(step, {"w": torch.full((256,), float(step))})
                    started.set()
            except BaseException as exc:  # noqa: BLE001 - what the loop would see
                seen.append(exc)
            finally:
                started.set()

        t = threading.Thread(target=saving)
        t.start()
        started.wait(30)
        ck.close()
        t.join(60)
        assert len(seen) == 1 and type(seen[0]) is incluster.CheckpointError, seen
        assert "this Checkpointer is closed" in str(seen[0])


def test_leaving_a_with_block_by_an_exception_raises_that_exception_not_a_failed_save(local_dir, caplog):
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones_like(p)
    opt.step()  # complex state: refused as the step is staged, raised by close()
    with pytest.raises(ValueError, match="the body's own"):
        with incluster.Checkpointer(local_dir=local_dir, job="j", writer="thread") as ck:
            ck.save(1, {"opt": opt})
            time.sleep(0.5)
            raise ValueError("the body's own")
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert said and "close() on leaving the with-block (which raised ValueError) also failed" in said[0], said
    with pytest.raises(incluster.CheckpointError, match="complex64"):  # without an exception of its own: raised
        with incluster.Checkpointer(local_dir=local_dir, job="j2", writer="thread") as ck:
            ck.save(1, {"opt": opt})


def test_a_run_that_did_not_load_is_told_to_when_its_job_holds_newer_steps(local_dir):
    """Every save() of a new run on a job holding step 5 was refused with "already saved
    or being saved ... (continue from the step load() returned)", though load() was never
    called: the error names load() and a new job."""
    with incluster.Checkpointer(local_dir=local_dir, job="held", writer="thread") as ck:
        ck.save(5, {"w": torch.ones(8)}).wait()
    with incluster.Checkpointer(local_dir=local_dir, job="held", writer="thread") as ck:
        with pytest.raises(incluster.CheckpointError, match=r"already holds step 5 on this node from an earlier run, "
                                                            r"and this run did not call load\(\)"):
            ck.save(3, {"w": torch.ones(8)})
        ck.save(6, {"w": torch.ones(8)}).wait()  # a newer step goes on
