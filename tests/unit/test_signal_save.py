"""A stop signal's handler that saves while the loop is inside save(): the handler's call
cannot finish before the handler returns (it would run over the half-done save's locks:
a deadlock that lost the run's last checkpoint). Refused at once, naming the pattern that
works; the interrupted save and the run go on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import incluster
from incluster import checkpointer as ckpt_mod


@pytest.mark.parametrize("call", ["save", "close"])
def test_a_save_from_a_handler_that_interrupted_save_is_refused_not_deadlocked(local_dir, monkeypatch, call):
    state = {"w": torch.arange(1000.0)}
    said: list[str] = []
    ck = incluster.Checkpointer(local_dir=local_dir, job="sig", writer="thread", slot_timeout_s=20)
    real = ckpt_mod.snapshot

    def handler(*_):
        try:
            if call == "save":
                ck.save(99, state).wait(30)
            else:
                ck.close()
            said.append("ran")
        except incluster.CheckpointError as exc:
            said.append(str(exc))

    def interrupted(*a, **k):  # the signal lands (once) while the loop's save() is under way
        if not said:
            said.append("")
            signal.raise_signal(signal.SIGUSR1)
            said.pop(0)
        return real(*a, **k)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        monkeypatch.setattr(ckpt_mod, "snapshot", interrupted)
        ck.save(1, state).wait(30)  # the interrupted save lands
        monkeypatch.setattr(ckpt_mod, "snapshot", real)
        assert len(said) == 1 and f"{call}() was called inside save() on the same thread" in said[0], said
        assert "set a flag and save from the training loop" in said[0]
        ck.save(2, state).wait(30)  # what the handler's flag leads to: the loop saves next
    finally:
        signal.signal(signal.SIGUSR1, old)
        ck.close()
    target = {"w": torch.zeros(1000)}
    with incluster.Checkpointer(local_dir=local_dir, job="sig", writer="thread") as again:
        assert again.load(target) == 2 and torch.equal(target["w"], state["w"])


@pytest.mark.parametrize("inside", ["load", "wait"])
def test_a_save_from_a_handler_that_interrupted_load_or_wait_is_refused(local_dir, monkeypatch, inside):
    """Inside load(), the handler's save() took a half-restored state (part of the tensors
    restored, part not) and saved it as a new step - a torn state a restart would load;
    inside wait() while it holds its lock, it deadlocked on it. Refused at once; the
    interrupted call ends as it would have."""
    from incluster import loading

    saved = {"w": torch.arange(1000.0), "v": torch.arange(500.0)}
    with incluster.Checkpointer(local_dir=local_dir, job="sig3", writer="thread") as ck:
        ck.save(1, saved).wait(30)
    live = {"w": torch.zeros(1000), "v": torch.zeros(500)}
    said: list[str] = []
    ck = incluster.Checkpointer(local_dir=local_dir, job="sig3", writer="thread", slot_timeout_s=20)

    def handler(*_):
        try:
            ck.save(7, live)
            said.append("ran")
        except incluster.CheckpointError as exc:
            said.append(str(exc))

    real = loading.restore

    def interrupted(*a, **k):  # the restore is under way
        signal.raise_signal(signal.SIGUSR1)
        return real(*a, **k)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        if inside == "load":
            monkeypatch.setattr(loading, "restore", interrupted)
            assert ck.load(live) == 1
        else:
            assert ck.load(live) == 1
            ck.save(2, live)
            monkeypatch.setattr(ck, "_lock", _SignalledLock(ck._lock))  # the signal lands under the lock
            ck.wait()
        assert len(said) == 1 and f"save() was called inside {inside}() on the same thread" in said[0], said
        assert torch.equal(live["w"], saved["w"]) and torch.equal(live["v"], saved["v"])
        ck.save(8, live).wait(30)
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGUSR1, old)
        ck.close()
    with incluster.Checkpointer(local_dir=local_dir, job="sig3", writer="thread") as again:
        back = {"w": torch.zeros(1000), "v": torch.zeros(500)}
        assert again.load(back) == 8 and torch.equal(back["w"], saved["w"])


class _SignalledLock:
    """A lock that raises SIGUSR1 (once) just after it is taken: the signal lands while
    the holder is inside its locked section."""

    def __init__(self, lock) -> None:
        self._lock, self._fired = lock, False

    def __enter__(self):
        self._lock.acquire()
        if not self._fired and threading.current_thread() is threading.main_thread():
            self._fired = True
            signal.raise_signal(signal.SIGUSR1)
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_a_handler_that_interrupts_a_wait_blocked_on_a_saves_outcome_still_saves(local_dir, monkeypatch):
    """The common preemption: SIGTERM while the loop waits (its periodic or final
    wait()) for a save's outcome. Nothing is held there, so the handler's last save
    goes through and a restart loads it."""
    from incluster.staging.engine import Stager

    run = Stager.run
    gate = threading.Event()

    def held(self, job):  # save 1 stays in flight until the handler runs: wait() blocks on it
        gate.wait(30)
        return run(self, job)

    monkeypatch.setattr(Stager, "run", held)
    state = {"w": torch.arange(100.0)}
    ck = incluster.Checkpointer(local_dir=local_dir, job="sig4", writer="thread", slot_timeout_s=20)
    done: list[int] = []

    def handler(*_):
        gate.set()
        ck.save(2, {"w": state["w"] + 1}).wait(30)
        done.append(2)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        ck.save(1, state)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        ck.wait(30)  # interrupted by the handler, then goes on
        assert done == [2]
    finally:
        signal.signal(signal.SIGUSR1, old)
        ck.close()
    with incluster.Checkpointer(local_dir=local_dir, job="sig4", writer="thread") as again:
        back = {"w": torch.zeros(100)}
        assert again.load(back) == 2 and torch.equal(back["w"], state["w"] + 1)


def test_a_handler_outside_any_save_still_saves(local_dir):
    """The common case stays: a signal between steps, the handler's save and close() run."""
    state = {"w": torch.arange(10.0)}
    ck = incluster.Checkpointer(local_dir=local_dir, job="sig2", writer="thread")
    ck.save(1, state).wait(30)
    done: list[int] = []

    def handler(*_):
        ck.save(2, state).wait(30)
        ck.close()
        done.append(2)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        signal.raise_signal(signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert done == [2]
    with incluster.Checkpointer(local_dir=local_dir, job="sig2", writer="thread") as again:
        assert again.load({"w": torch.zeros(10)}) == 2


def test_a_forked_child_saving_through_its_parents_checkpointer_is_refused_by_name(local_dir):
    """It timed out with an empty TimeoutError (the staging thread and writer stayed in the
    parent); the parent goes on saving."""
    import os

    ck = incluster.Checkpointer(local_dir=local_dir, job="forked", writer="thread", slot_timeout_s=20)
    try:
        ck.save(1, {"w": torch.ones(4)}).wait(30)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what save() said, then leave without any clean-up
            try:
                ck.save(2, {"w": torch.ones(4)})
                text = "saved"
            except incluster.CheckpointError as exc:
                text = str(exc)
            t0 = time.monotonic()
            ck.close()  # a child leaving a with-block: nothing of the parent's is touched (it waited 20 s
            text += f"|close {time.monotonic() - t0:.1f}"  # for the parent's staging thread, then checked out)
            os.write(w, text.encode()[:4000])
            os._exit(0)
        os.close(w)
        said = os.read(r, 4000).decode()
        os.waitpid(pid, 0)
        assert f"made in process {os.getpid()}; a forked child" in said, said
        assert float(said.rsplit("|close ", 1)[1]) < 5, said
        ck.save(3, {"w": torch.ones(4)}).wait(30)  # the parent's writer and threads are still its own
    finally:
        ck.close()
