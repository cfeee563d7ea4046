"""save()'s copies of unguarded CPU tensors go into reused memory: lent to one save,
given back only once it is staged, made ahead by prepare(), bounded between saves."""

from __future__ import annotations

import threading

import pytest
import torch

import incluster
from incluster.guard import POOL_MIN, ClonePool
from incluster.staging.engine import Stager
from incluster.tiers.local import ShardReader

N = POOL_MIN // 4  # float32 elements: one pooled buffer each


@pytest.fixture
def held_staging(monkeypatch):
    """Staging waits for ``release``: saves pile up before any is staged."""
    release = threading.Event()
    run = Stager.run

    def late(self, job):
        release.wait(30)
        return run(self, job)

    monkeypatch.setattr(Stager, "run", late)
    yield release
    release.set()


def _stored(folder, step, name):
    with ShardReader(folder, step) as r:
        return r.tensor(name).clone()


def test_a_buffer_is_not_lent_again_before_its_save_is_staged(local_dir, held_staging):
    """Two saves before either is staged: the second must not reuse the first's buffer,
    or the first step would hold the second's values."""
    w = torch.zeros(N)
    with incluster.Checkpointer(local_dir=local_dir, job="pool", writer="thread", keep=3) as ck:
        h1 = ck.save(1, {"w": w})
        w.fill_(1.0)  # not an optimizer step: nothing waits; save() copied the value
        h2 = ck.save(2, {"w": w})
        w.fill_(2.0)
        held_staging.set()
        h1.wait()
        h2.wait()
        assert torch.equal(_stored(ck.folder, 1, "w"), torch.zeros(N))
        assert torch.equal(_stored(ck.folder, 2, "w"), torch.ones(N))


def test_saves_reuse_one_buffer_once_each_is_staged(local_dir):
    w = torch.arange(N, dtype=torch.float32)
    with incluster.Checkpointer(local_dir=local_dir, job="pool", writer="thread") as ck:
        lent: list[torch.Tensor] = []
        seen = []
        clone = ck._clones.clone

        def spy(t, lent):
            out = clone(t, lent)
            seen.append(out.data_ptr())
            return out

        ck._clones.clone = spy  # type: ignore[method-assign]
        for step in range(1, 4):
            w.add_(1.0)
            ck.save(step, {"w": w}).wait()
            assert ck._clones.free_bytes == w.nbytes  # given back, kept for the next save
            assert torch.equal(_stored(ck.folder, step, "w"), torch.arange(N, dtype=torch.float32) + step)
        assert len(set(seen)) == 1, "each save allocated its own copy"
        assert not lent


def test_prepare_makes_the_buffers_the_first_save_uses(local_dir):
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    ema = {"w": torch.ones(N), "small": torch.ones(4), "half": torch.ones(2 * N, dtype=torch.bfloat16)}
    state = {"model": model, "optim": optim, "ema": ema}
    with incluster.Checkpointer(local_dir=local_dir, job="pool", writer="thread") as ck:
        ck.prepare(state).result(30)
        # the parameters are guarded by the optimizer; the small tensor is cloned fresh
        assert ck._clones.free_bytes == ema["w"].nbytes + ema["half"].nbytes
        ck._clones.keep_bytes = 0  # nothing given back is kept: free_bytes now counts only lent buffers
        h = ck.save(1, state)
        assert ck._clones.free_bytes == 0  # both taken by the save, none made
        h.wait()


def test_a_strided_view_is_copied_with_its_values():
    base = torch.arange(2 * N, dtype=torch.float32).view(2, N)
    view = base.t()  # not contiguous
    pool, lent = ClonePool(), []
    out = pool.clone(view, lent)
    assert out.shape == view.shape and torch.equal(out, view) and lent == [out]
    pool.give_back(lent)
    again: list[torch.Tensor] = []
    base.mul_(3)
    out2 = pool.clone(view, again)
    assert out2.data_ptr() == out.data_ptr() and torch.equal(out2, view)


def test_gpu_and_small_tensors_are_not_pooled():
    pool, lent = ClonePool(), []
    small = torch.ones(8)
    out = pool.clone(small, lent)
    assert torch.equal(out, small) and out.data_ptr() != small.data_ptr() and lent == []


def test_between_saves_at_most_keep_bytes_stay_and_old_shapes_go_first():
    pool = ClonePool(keep_bytes=3 * POOL_MIN + 8)  # room for both new and one old
    old: list[torch.Tensor] = []
    for _ in range(2):
        pool.clone(torch.zeros(N), old)
    pool.give_back(old)
    assert pool.free_bytes == 2 * POOL_MIN
    new: list[torch.Tensor] = []
    for _ in range(2):
        pool.clone(torch.zeros(N + 1), new)  # another shape: both made afresh
    assert pool.free_bytes == 2 * POOL_MIN
    pool.give_back(new)
    taken: list[torch.Tensor] = []
    pool.clone(torch.zeros(N + 1), taken)
    pool.clone(torch.zeros(N + 1), taken)
    assert len({b.data_ptr() for b in taken}) == 2
    assert pool.free_bytes == N * 4  # both new ones kept; one of the old shape went


def test_warm_makes_touched_buffers_within_the_budget():
    pool = ClonePool(keep_bytes=2 * POOL_MIN)
    made = pool.warm([(torch.float32, (N,)), (torch.float32, (N,)), (torch.float32, (N,)), (torch.float32, (4,))])
    assert made == 2 * POOL_MIN and pool.free_bytes == 2 * POOL_MIN
    assert pool.warm([(torch.float32, (N,))]) == 0  # already there


def test_a_failed_save_gives_its_buffers_back(local_dir, monkeypatch):
    w = torch.zeros(N)
    with incluster.Checkpointer(local_dir=local_dir, job="pool", writer="thread") as ck:
        def full(step, timeout):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ck.ring, "acquire", full)
        with pytest.raises(incluster.TierUnavailableError):
            ck.save(1, {"w": w})
        assert ck._clones.free_bytes == w.nbytes
        monkeypatch.undo()
        ck.save(2, {"w": w}).wait()
