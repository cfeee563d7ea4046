"""The CUDA path: ordering of the optimizer step after the copies (checked with the copies
deliberately delayed on the GPU), the device-side snapshot and its fallback, page-locked
slots (also after a re-map), and restores into GPU tensors.

Runs only where CUDA is available (marker ``gpu``); CPU-only runs skip it.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

import incluster
from incluster.staging import cuda as cuda_mod
from incluster.staging import device_snapshot
from incluster.state import flatten
from incluster.tiers.local import ShardReader

pytestmark = pytest.mark.gpu
DELAY = int(4e8)  # GPU clock cycles (~0.2 s): longer than a forward, backward and step here


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    m(torch.randn(64, 1024, device="cuda")).pow(2).mean().backward()
    o.step()
    o.zero_grad()


@pytest.fixture
def delayed_copies(monkeypatch):
    """Every staging copy is enqueued behind a ~0.2 s sleep on its side stream: an
    optimizer step the GPU does not order after the copies lands in the checkpoint."""
    snap, enqueue = device_snapshot.snap, cuda_mod.CudaCopier.enqueue

    def late_snap(plan, tensors, stream, start):
        with torch.cuda.device(plan.device), torch.cuda.stream(stream):
            torch.cuda._sleep(DELAY)
        return snap(plan, tensors, stream, start)

    def late_enqueue(self, pairs, start, *more, **kw):
        for dev in {src.get_device() for _, src in pairs}:
            with torch.cuda.device(dev), torch.cuda.stream(self.stream(dev)):
                torch.cuda._sleep(DELAY)
        return enqueue(self, pairs, start, *more, **kw)

    monkeypatch.setattr(device_snapshot, "snap", late_snap)
    monkeypatch.setattr(cuda_mod.CudaCopier, "enqueue", late_enqueue)


def _expected(state):
    torch.cuda.synchronize()
    flat = flatten(state)
    return {s.name: t.detach().cpu().clone() for s, t in zip(flat.specs, flat.tensors)}


def _assert_shard(folder, step, expected):
    with ShardReader(folder, step) as r:
        differ = [n for n, v in expected.items() if not torch.equal(r.tensor(n), v)]
    assert not differ, f"{len(differ)} of {len(expected)} tensors hold values from after save(): {differ[:4]}"


def _wait_writer_drains(ck, seconds: float = 120.0) -> None:
    """The writer process has the device-side snapshot open (it is shared after a save)."""
    deadline = time.monotonic() + seconds
    while not ck.gpu_drain_in_writer:
        assert time.monotonic() < deadline, "the writer never opened the device-side snapshot"
        time.sleep(0.05)


@pytest.fixture
def remote_steps(monkeypatch):
    """Steps whose drain was handed to the writer process."""
    from incluster.staging.remote_drain import RemoteDrain

    steps: list[int] = []
    begin = RemoteDrain.begin

    def record(self, step):
        steps.append(step)
        return begin(self, step)

    monkeypatch.setattr(RemoteDrain, "begin", record)
    return steps


@pytest.mark.parametrize(
    "gpu_snapshot,drain", [(None, "writer"), (None, "trainer"), (0, "writer")],
    ids=["snapshot-writer-drains", "snapshot-trainer-drains", "direct"],
)
def test_optimizer_step_right_after_save_is_ordered_after_the_copies(
    local_dir, delayed_copies, remote_steps, gpu_snapshot, drain
):
    m, o = _model()
    with incluster.Checkpointer(
        local_dir=local_dir, job="order", replicas=0, gpu_snapshot=gpu_snapshot, gpu_drain=drain
    ) as ck:
        _step(m, o)
        state = {"model": m, "optim": o}
        ck.save(1, state).wait()  # slots ready
        if gpu_snapshot is None and drain == "writer":
            _wait_writer_drains(ck)
        _step(m, o)
        expected = _expected(state)
        h = ck.save(2, state)
        _step(m, o)  # no synchronization: the pre-step hook must order the update on the GPU
        h.wait()
        assert ck.gpu_snapshot_active is (gpu_snapshot is None)
        assert (2 in remote_steps) is (gpu_snapshot is None and drain == "writer")
        if 2 in remote_steps:  # the save's timeline: the writer read the buffer, then committed
            assert h.staged_s <= h.drained_s <= h.committed_s <= h.durable_s
        else:
            assert h.drained_s is None
        _assert_shard(ck.folder, 2, expected)


@pytest.mark.parametrize("gpu_snapshot", [None, 0], ids=["snapshot", "direct"])
def test_an_update_still_queued_on_the_gpu_at_save_is_in_the_checkpoint(local_dir, gpu_snapshot):
    """save() right after an in-place update the GPU has not run yet (queued behind a
    ~0.2 s sleep on the compute stream, nothing synchronized): the side-stream copies
    must wait for the work queued before save(), so the checkpoint holds the updated
    values. A BatchNorm buffer the next forward changes right after save() keeps its
    save-time value (cloned on the compute stream, behind the update). The loop runs on
    a stream of its own: the event save() records there is all that orders the copies
    (the default stream, which the staging thread's fallback would wait on, is idle)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024),
                            torch.nn.Linear(1024, 1024)).cuda()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    state = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="queued", replicas=0, gpu_snapshot=gpu_snapshot) as ck:
        _step(m, o)
        ck.save(1, state).wait()  # slots (and the snapshot buffer) ready
        before = _expected(state)  # synchronized
        params = {p.data_ptr() for p in m.parameters()}
        flat = flatten(state)
        expected = {s.name: before[s.name] + 1 if t.data_ptr() in params else before[s.name]
                    for s, t in zip(flat.specs, flat.tensors)}
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(DELAY)  # the update below waits behind it on this stream
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)
            h = ck.save(2, state)
            m(torch.randn(64, 1024, device="cuda"))  # train-mode forward: BatchNorm's statistics change
        h.wait()
        assert ck.gpu_snapshot_active is (gpu_snapshot is None)
        _assert_shard(ck.folder, 2, expected)


def test_a_writer_killed_while_it_drains_loses_only_that_save(local_dir, remote_steps):
    """SIGKILL the writer right after it took a drain: that save fails, the buffer is
    free again, the next saves drain in the trainer until a new writer opens it."""
    m, o = _model()
    _step(m, o)
    state = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="kill-drain", replicas=0) as ck:
        ck.prepare(state).result(120)
        _wait_writer_drains(ck)
        ck.save(1, state).wait()
        assert remote_steps == [1]
        _step(m, o)
        h = ck.save(2, state)
        h.staged.result(60)
        os.kill(ck.writer_pid, signal.SIGKILL)
        try:
            h.wait()
        except incluster.CheckpointError:
            pass  # lost with the writer (or committed just before the kill)
        for step in (3, 4):
            _step(m, o)
            expected = _expected(state)
            ck.save(step, state).wait()
            _assert_shard(ck.folder, step, expected)
        _wait_writer_drains(ck)  # the new writer has it open again
        _step(m, o)
        expected = _expected(state)
        ck.save(5, state).wait()
        assert 5 in remote_steps
        _assert_shard(ck.folder, 5, expected)


def test_saves_every_step_drained_by_the_writer_each_hold_their_own_step(local_dir, remote_steps):
    """keep=3: the writer copies step N+1 out of the snapshot while it still hashes and
    commits step N; every committed shard holds exactly its own step's values."""
    m, o = _model()
    _step(m, o)
    state = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="every-step", replicas=0, keep=3) as ck:
        ck.prepare(state).result(120)
        _wait_writer_drains(ck)
        expected, handles = {}, []
        for step in range(1, 9):
            _step(m, o)
            expected[step] = _expected(state)
            handles.append(ck.save(step, state))
        for h in handles:
            h.wait(120)
        assert remote_steps == list(range(1, 9))
        for step in (6, 7, 8):  # the three the ring keeps
            _assert_shard(ck.folder, step, expected[step])
        assert all(h.staged_s <= h.drained_s <= h.durable_s for h in handles)


def test_plain_dict_state_is_ordered_too(local_dir, delayed_copies):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = _model()
    with incluster.Checkpointer(local_dir=local_dir, job="order-dict", replicas=0) as ck:
        _step(m, o)
        msd, osd = get_state_dict(m, o)
        state = {"model": msd, "optim": osd}
        expected = _expected(state)
        h = ck.save(1, state)
        _step(m, o)
        h.wait()
        _assert_shard(ck.folder, 1, expected)


def test_no_room_falls_back_to_direct_copies_and_says_so_once(local_dir, caplog):
    m, o = _model()
    _step(m, o)
    state = {"model": m, "optim": o}
    with caplog.at_level(logging.WARNING, logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, job="fallback", replicas=0, gpu_snapshot=1) as ck:
            for step in (1, 2):
                expected = _expected(state)
                ck.save(step, state).wait()
                _assert_shard(ck.folder, step, expected)
                _step(m, o)
            assert ck.gpu_snapshot_active is False
    said = [r for r in caplog.records if "no device-side snapshot" in r.getMessage()]
    assert len(said) == 1


def test_prepare_page_locks_every_slot_before_the_first_save(local_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="incluster")
    m, o = _model()
    _step(m, o)
    state = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="prep", replicas=0) as ck:
        ck.prepare(state).result(120)
        assert not [r for r in caplog.records if "not warmed" in r.getMessage()]  # the snapshot's copies ran once
        assert len(ck.ring.slots) == ck.ring.keep
        for s in ck.ring.slots:
            assert s.pinned and s.buf is not None and s.buf.is_pinned(), s.index
        maps = [s.maps for s in ck.ring.slots]
        for step in range(1, 4):
            _step(m, o)
            ck.save(step, state).wait()
        assert [s.maps for s in ck.ring.slots] == maps


@pytest.mark.parametrize("gpu_snapshot", [0, None], ids=["direct", "snapshot-writer-drains"])
def test_a_remapped_slot_is_page_locked_again(local_dir, gpu_snapshot):
    m, o = _model()
    _step(m, o)
    with incluster.Checkpointer(local_dir=local_dir, job="remap", replicas=0, gpu_snapshot=gpu_snapshot) as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        ck.save(2, {"model": m, "optim": o}).wait()
        extra = torch.randn(3, 1 << 20, device="cuda")  # the shard grows by 12 MiB: slots re-map
        state = {"model": m, "optim": o, "extra": extra}
        for step in (3, 4, 5):
            expected = _expected(state)
            ck.save(step, state).wait()
            _assert_shard(ck.folder, step, expected)
        ck._stage_pool.submit(lambda: None).result(60)
        for s in ck.ring.slots:
            if s.buf is not None:
                assert s.pinned and s.buf.is_pinned(), s.index
        assert any(s.maps > 1 for s in ck.ring.slots)


@pytest.mark.parametrize("gpu_snapshot", [0, None], ids=["direct", "snapshot-trainer-drains"])
def test_memory_cuda_refuses_to_page_lock_is_saved_into_unlocked_and_bitwise(local_dir, gpu_snapshot, monkeypatch,
                                                                             caplog):
    """A real refusal (an invalid flag: cudaErrorInvalidValue). Saves used to fail; and the
    refusal's error, left as its thread's last CUDA error, was read by torch after that
    thread's next kernel launch (the staging thread's copies). Now: said once, saved
    unlocked, bitwise, and the training thread's kernels are unaffected."""
    monkeypatch.setattr(cuda_mod, "HOST_REGISTER_PORTABLE", 0x80)
    monkeypatch.setattr(cuda_mod, "_refused", None)
    m, o = _model()
    _step(m, o)
    state = {"model": m, "optim": o}
    with caplog.at_level(logging.WARNING, logger="incluster"):
        with incluster.Checkpointer(local_dir=local_dir, job="unlocked", replicas=0, gpu_snapshot=gpu_snapshot,
                                    gpu_drain="trainer") as ck:
            for step in (1, 2, 3):
                expected = _expected(state)
                ck.save(step, state).wait()
                _assert_shard(ck.folder, step, expected)
                _step(m, o)
            assert not any(s.pinned for s in ck.ring.slots)
    torch.cuda.synchronize()
    said = [r.getMessage() for r in caplog.records if "could not page-lock" in r.getMessage()]
    assert len(said) == 1, said


def test_an_empty_gpu_tensor_before_a_large_cpu_one_is_saved_through_the_snapshot(local_dir):
    """Its file offset lies below the device buffer's first byte (every snapshot save of
    such a state failed on an unaligned view)."""
    state = {"e": torch.empty(0, device="cuda"), "c": torch.randn(3 << 18), "w": torch.randn(1 << 20, device="cuda"),
             "b": torch.tensor([True, False, True])}
    with incluster.Checkpointer(local_dir=local_dir, job="empty", replicas=0) as ck:
        for step in (1, 2):
            expected = _expected(state)
            ck.save(step, state).wait()
            _assert_shard(ck.folder, step, expected)
            state["w"].add_(1)
        assert ck.gpu_snapshot_active


def test_a_slot_cut_and_grown_back_is_page_locked_again_by_the_writer(local_dir, remote_steps):
    """The writer page-locks the free slots at the large size; prepare() of a smaller
    state cuts them; the next large save grows one back to the size the writer mapped.
    Same inode, same size: only the mapping generation says the writer's page-locked
    mapping still pins the pages the cut dropped (the drain's bytes would land there)."""
    m, o = _model()
    _step(m, o)
    big = {"model": m, "optim": o, "extra": torch.randn(4 << 20, device="cuda")}
    small = {"model": m, "optim": o}
    with incluster.Checkpointer(local_dir=local_dir, job="sizes", replicas=0, keep=2) as ck:
        ck.prepare(big).result(120)
        _wait_writer_drains(ck)  # the writer has the buffer open and the free slots page-locked
        ck.prepare(small).result(120)  # the free slots are cut to the small size; the buffer stays
        for step in (1, 2):
            _step(m, o)
            expected = _expected(big)
            ck.save(step, big).wait(120)
            _assert_shard(ck.folder, step, expected)
        assert 1 in remote_steps, "the writer did not drain the save"
        assert all(s.maps >= 3 for s in ck.ring.slots)


@pytest.mark.parametrize("gpu_snapshot", [None, 0], ids=["device-snapshot", "direct"])
def test_restore_into_gpu_tensors_is_bitwise_and_in_place(local_dir, gpu_snapshot):
    m, o = _model()
    for _ in range(2):
        _step(m, o)
    with incluster.Checkpointer(local_dir=local_dir, job="gpu", replicas=0, gpu_snapshot=gpu_snapshot) as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        _step(m, o)
        state = {"model": m, "optim": o}
        expected = _expected(state)
        ck.save(2, state).wait()
    m2, o2 = _model(seed=5)
    _step(m2, o2)
    ptrs = [p.data_ptr() for p in m2.parameters()]
    with incluster.Checkpointer(local_dir=local_dir, job="gpu", replicas=0) as ck:
        assert ck.load({"model": m2, "optim": o2}) == 2
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    got = _expected({"model": m2, "optim": o2})
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


_SHARE_AND_EXIT = """
import sys, time, torch, incluster
m = torch.nn.Linear(1024, 1024).cuda(); o = torch.optim.AdamW(m.parameters())
m(torch.randn(8, 1024, device="cuda")).sum().backward(); o.step()
with incluster.Checkpointer(local_dir=sys.argv[1], job="exit", replicas=0) as ck:
    ck.prepare({"m": m, "o": o}).result(120)
    t0 = time.monotonic()
    while not ck.gpu_drain_in_writer and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    assert ck.gpu_drain_in_writer
    ck.save(1, {"m": m, "o": o}).wait()
print("pid", __import__("os").getpid())
"""


def test_with_expandable_segments_the_writer_still_drains_the_snapshot(local_dir):
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: such memory is shared through file
    descriptors the writer takes with pidfd_getfd, which a child may not do to its parent
    under Yama's ptrace_scope=1 (and most containers): the writer could not open the
    buffer and the trainer drained every save. The buffer is allocated outside them."""
    import subprocess
    import sys

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,garbage_collection_threshold:0.8"}
    out = subprocess.run([sys.executable, "-c", _NOT_EXPANDABLE, local_dir], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cannot drain the device-side snapshot" not in out.stderr, out.stderr[-2000:]


_NOT_EXPANDABLE = """
import sys, time, torch, incluster
m = torch.nn.Linear(1024, 1024).cuda(); o = torch.optim.AdamW(m.parameters())
m(torch.randn(8, 1024, device="cuda")).sum().backward(); o.step()
with incluster.Checkpointer(local_dir=sys.argv[1], job="expandable", replicas=0) as ck:
    ck.prepare({"m": m, "o": o}).result(120)
    buf = ck._stager._device.buf
    seg = [s for s in torch.cuda.memory_snapshot() if s["address"] <= buf.data_ptr() < s["address"] + s["total_size"]]
    assert seg and seg[0].get("is_expandable") is False, seg[:1]  # shareable without pidfd_getfd
    t0 = time.monotonic()
    while not ck.gpu_drain_in_writer and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    assert ck.gpu_drain_in_writer
    ck.save(1, {"m": m, "o": o}).wait()
"""


def test_a_process_that_shared_its_snapshot_exits_clean(local_dir):
    """No warning about shared CUDA memory still held, no driver file left in /dev/shm."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHARE_AND_EXIT, local_dir], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    pid = int(out.stdout.split("pid")[-1])
    assert "Producer process has been terminated" not in out.stderr
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"cuda.shm.{os.getuid()}.{pid:x}.")]
    assert not left, left
