"""The GPU path's bookkeeping, checked on the CPU (tests/gpu checks it on a GPU): which
streams a save marks and makes wait, per GPU the state is on; a failed staging waits for
the copies it had enqueued; the device-side snapshot's views; the writer re-maps a slot
the trainer resized.

CUDA calls are replaced by fakes that record what they were asked; everything they are
asked comes from the real code under test.
"""

from __future__ import annotations

import mmap
import os

import pytest
import torch

import incluster
from incluster.format.layout import TensorSpec, build_layout
from incluster.staging import cuda
from incluster.staging.device_snapshot import DeviceSnapshots, buffer_views, make_runs
from incluster.staging.engine import Stager
from incluster.writer.protocol import WriterParams
from incluster.writer.service import CommitService


class FakeStream:
    def __init__(self, dev: int) -> None:
        self.dev, self.waited = dev, []

    def wait_event(self, ev) -> None:
        self.waited.append(ev)


class FakeEvent:
    def __init__(self) -> None:
        self.on, self.synced = None, False

    def record(self, stream) -> None:
        self.on = stream.dev

    def synchronize(self) -> None:
        self.synced = True


@pytest.fixture
def gpus(monkeypatch):
    """Three fake GPUs with contexts on 1 and 2 (the current device stays 0): per device,
    the trainer's current stream."""
    streams = {d: FakeStream(d) for d in range(3)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: d in (1, 2), raising=False)

    def current_stream(device=None):
        assert device is not None, "a stream of the current device (0) was asked for, not the state's GPU's"
        return streams[device]

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return streams


def test_save_marks_every_gpu_in_use_not_the_current_device(gpus):
    """Even one the state moved to since the last save (known: only 1); never GPU 0,
    which has no context: marking it would make one there."""
    marks = cuda.record_start((1,))
    assert sorted(marks) == [1, 2]
    assert [marks[d].on for d in (1, 2)] == [1, 2]


def test_where_torch_cannot_tell_which_gpus_are_in_use_save_marks_the_states(gpus, monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_hasPrimaryContext")
    assert sorted(cuda.record_start((1, 2))) == [1, 2]


def test_the_optimizer_step_waits_on_each_gpus_own_stream(gpus):
    a, b = FakeEvent(), FakeEvent()
    cuda.wait_on_compute([(1, a), (2, b)])
    assert gpus[1].waited == [a] and gpus[2].waited == [b] and gpus[0].waited == []


class FakeCopier:
    def __init__(self) -> None:
        self.side = FakeEvent()  # a stream: synchronize() is all _settle asks of it

    def streams(self):
        return [self.side]


@pytest.mark.parametrize("evented", [True, False], ids=["with-its-event", "enqueue-failed-half-way"])
def test_a_staging_error_after_copies_were_enqueued_waits_for_them(local_dir, monkeypatch, evented):
    """The slot goes back to the ring when staging fails: copies still landing in it
    would write into the next save's bytes (or into a re-mapped file). Also copies with
    no event yet (an enqueue that failed on a later device): their stream is waited for."""
    in_flight, copier = FakeEvent(), FakeCopier()

    def enqueue_then_fail(self, job, tensors, layout):
        self._cuda = copier
        if evented:
            job.cuda_done = [(1, in_flight)]
        raise RuntimeError("a copy failed after GPU copies were enqueued")

    monkeypatch.setattr(Stager, "_copy_direct", enqueue_then_fail)
    with incluster.Checkpointer(local_dir=local_dir, job="fail", replicas=0) as ck:
        h = ck.save(1, {"w": torch.ones(8)})
        with pytest.raises(Exception, match="copy failed"):
            h.wait(30)
        assert copier.side.synced and in_flight.synced is evented
        ck._stager._cuda = None  # close() must not reach the fake


def test_snapshot_views_leave_out_empty_gpu_tensors_below_the_buffer():
    """An empty GPU tensor placed before a large CPU tensor has its file offset below the
    buffer's first byte: a view there started somewhere else in the buffer (unaligned for
    its dtype: every snapshot save of that state failed)."""
    specs = [TensorSpec("e", "F32", (0,)), TensorSpec("c", "F32", (3 << 18,)), TensorSpec("w", "F32", (1 << 20,)),
             TensorSpec("b", "BOOL", (3,))]
    kinds = ["g", "c", "g", "s"]
    layout = build_layout(specs)
    lo, hi, runs = make_runs(layout, kinds)
    assert layout.entries[0].offset < lo
    buf = torch.zeros(hi - lo, dtype=torch.uint8)
    gpu, views, inside = buffer_views(layout, kinds, lo, runs, buf)
    assert gpu == [2]
    views[0].fill_(1.5)
    w = layout.entries[2]
    assert torch.equal(buf[w.offset - lo : w.offset - lo + w.nbytes].view(torch.float32), views[0])
    assert sorted(inside) == [3] and inside[3].shape == (3,)


def test_a_tensor_moved_onto_the_gpu_between_saves_gets_a_place_in_the_snapshot(monkeypatch):
    """The plans are cached per layout: a tensor of the same name, dtype and shape that was
    on the CPU at the first save and is on the GPU at the next (an EMA copy moved over) was
    left out of the cached plan, so no copy wrote it and the slot kept an older step's
    bytes. The CPU stands in for the device: a buffer of ``need`` bytes, device -1."""
    snaps = DeviceSnapshots(None)

    def room(dev: int, need: int) -> bool:
        if snaps.buf is None or snaps.buf.numel() < need:
            snaps.buf, snaps._plans = torch.zeros(need, dtype=torch.uint8), {}
        return True

    monkeypatch.setattr(snaps, "_room", room)
    specs = [TensorSpec("w", "F32", (1 << 18,)), TensorSpec("ema", "F32", (1 << 18,)), TensorSpec("v", "F32", (1 << 18,))]
    layout = build_layout(specs)
    tensors = [torch.zeros(1 << 18) for _ in specs]
    first = snaps.plan(layout, tensors, ["g", "c", "g"])
    assert first is not None and first.gpu == [0, 2] and snaps.active
    assert snaps.plan(layout, tensors, ["g", "c", "g"]) is first  # the same kinds: the cached plan
    moved = snaps.plan(layout, tensors, ["g", "g", "g"])
    assert moved is not None and moved.gpu == [0, 1, 2] and len(moved.views) == 3
    assert moved.runs == [(layout.entries[0].offset, layout.entries[2].offset + layout.entries[2].nbytes)]
    assert snaps.plan(layout, tensors, ["c", "c", "c"]) is None and not snaps.active  # nothing on the GPU now


def test_the_writer_maps_a_slot_again_after_the_trainer_resized_it(tmp_path):
    """Cut and grown back to its old size, a slot file keeps its inode and size, but its
    pages past the cut are new: a mapping page-locked before still pins the old ones."""
    service = CommitService(WriterParams(rank=0, gen=0, store=None, outcome_timeout_s=5, local_dir=str(tmp_path)))
    unmapped: list[mmap.mmap] = []
    service.on_unmap = unmapped.append
    path = str(tmp_path / "slot")
    with open(path, "wb") as f:
        f.truncate(1 << 16)
    try:
        first = service.map_slot("0", path, 1 << 16, populate=False, gen=1)
        assert service.map_slot("0", path, 1 << 16, populate=False, gen=1) is first
        os.truncate(path, 4096)
        os.truncate(path, 1 << 16)
        again = service.map_slot("0", path, 1 << 16, populate=False, gen=3)
        assert again is not first and unmapped == [first]
    finally:
        service.close(5)


class FakeCudart:
    """Records each registration call and the thread it ran on; answers ``code``."""

    def __init__(self, code: int) -> None:
        self.code, self.calls = code, []

    def cudaHostRegister(self, ptr, size, flags):
        import threading

        self.calls.append(("register", size, threading.get_ident()))
        return self.code

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", 0, 0))
        return 0

    def cudaGetErrorString(self, err):
        return "out of memory"


@pytest.fixture
def cudart(monkeypatch):
    import contextlib
    import threading

    def make(code: int) -> FakeCudart:
        fake = FakeCudart(code)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "_refused", None)
        return fake

    make.caller = threading.get_ident()
    return make


def _mapped_slot(local_dir, size=1 << 16):
    from incluster.staging.slots import SlotRing

    ring = SlotRing(os.path.join(local_dir, "j", "rank-00000"), keep=1)
    slot = ring.acquire(1, timeout=5)
    ring.prepare(slot, size)
    return ring, slot


def test_memory_that_cannot_be_page_locked_is_used_as_it_is_said_once_never_tried_again(local_dir, cudart, caplog):
    """A refused cudaHostRegister (a local_dir the driver will not pin, a limit) failed
    every GPU save; and the refusal's CUDA error, left as the calling thread's last error,
    would be read by torch after the staging thread's next kernel launch. Now the slot is
    used unpinned, the user is told once, nothing is retried, and the call ran on a thread
    of its own."""
    fake = cudart(2)
    ring, slot = _mapped_slot(local_dir)
    try:
        with caplog.at_level("WARNING", logger="incluster"):
            cuda.register(slot, 0)
            cuda.register(slot, 0)
        assert not slot.pinned
        assert [c[0] for c in fake.calls] == ["register"]  # tried once in the process
        assert fake.calls[0][2] != cudart.caller  # not on the calling (staging) thread
        said = [r.getMessage() for r in caplog.records if "page-lock" in r.getMessage()]
        assert len(said) == 1 and "out of memory" in said[0] and "/dev/shm" in said[0], said
        cuda.unregister(slot)  # nothing was registered: nothing to undo
        assert [c[0] for c in fake.calls] == ["register"]
    finally:
        ring.close()


def test_page_locked_memory_is_registered_in_the_states_gpu_context_and_undone(local_dir, cudart):
    fake = cudart(0)
    ring, slot = _mapped_slot(local_dir)
    try:
        cuda.register(slot, 1)
        assert slot.pinned and slot.pinned_on == 1 and fake.calls[0][1] == 1 << 16
        cuda.unregister(slot)
        assert not slot.pinned and [c[0] for c in fake.calls] == ["register", "unregister"]
    finally:
        ring.close()


def test_page_locking_from_an_exit_hook_runs_inline(local_dir, cudart, monkeypatch):
    """close() from an exit hook: the registration thread's pool no longer takes work
    (interpreter shutdown); unregistering raised there and close() left the job store
    and its claim unreleased."""
    from concurrent.futures import ThreadPoolExecutor

    fake = cudart(0)
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    monkeypatch.setattr(cuda, "_pinner", pool)
    ring, slot = _mapped_slot(local_dir)
    try:
        cuda.register(slot, 0)
        cuda.unregister(slot)
        assert [c[0] for c in fake.calls] == ["register", "unregister"] and not slot.pinned
    finally:
        ring.close()


def test_a_snapshot_buffer_the_gpu_had_no_room_for_is_not_tried_again_at_every_save(monkeypatch):
    """With gpu_snapshot=<bytes> over what the GPU has free, the allocation failed at every
    save - each failure has torch's caching allocator free every cached block and retry, a
    device-wide stall on the training GPU per save. Now tried again only after RETRY_S;
    a smaller buffer (a smaller state) is still tried."""
    import contextlib

    from incluster.staging import device_snapshot

    tried: list[int] = []

    def zeros(n, dtype=None, device=None):
        tried.append(n)
        if n >= 1 << 20:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return torch.empty(n, dtype=dtype)

    monkeypatch.setattr(device_snapshot.torch, "zeros", zeros)
    monkeypatch.setattr(device_snapshot.torch.cuda, "mem_get_info", lambda dev: (1 << 30, 1 << 31))
    monkeypatch.setattr(device_snapshot.torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(device_snapshot.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(device_snapshot.torch.cuda, "current_stream", lambda dev=None: FakeStream(0))
    snaps = DeviceSnapshots(1 << 30)  # an explicit budget: free memory is not asked
    assert not snaps._room(0, 4 << 20)
    assert not snaps._room(0, 4 << 20) and not snaps._room(0, 8 << 20)
    assert tried == [4 << 20]
    assert snaps._room(0, 1 << 19) and tried == [4 << 20, 1 << 19]  # smaller: tried, and it fits
    monkeypatch.setattr(device_snapshot, "RETRY_S", 0.0)  # memory may have freed up since: tried again
    assert not snaps._room(0, 4 << 20) and tried == [4 << 20, 1 << 19, 4 << 20]
