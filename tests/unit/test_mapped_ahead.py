"""After a restart every slot may hold a step: the one the next save takes over is mapped
ahead (off the training path), and is among the slot files a writer process that drains
the device-side snapshot page-locks ahead (``gpu_drain="writer"``; the telling of it is
in test_remote_drain.py; the page-locking itself needs CUDA)."""

from __future__ import annotations

import torch

import incluster
from incluster.staging.slots import SlotState


def _state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.nn.Linear(64, 64)}


def test_the_slot_the_next_save_takes_over_is_mapped_ahead_and_offered_for_page_locking(local_dir):
    state = _state()
    with incluster.Checkpointer(local_dir=local_dir, job="ahead", keep=2, writer="thread") as ckpt:
        for step in (1, 2):
            ckpt.save(step, state).durable.result(30)
    with incluster.Checkpointer(local_dir=local_dir, job="ahead", keep=2, writer="thread") as ckpt:
        assert ckpt.load(state) == 2
        ckpt._stage_pool.submit(lambda: None).result(30)  # after load()'s preparing of the slots (staging thread)
        slots = {s.step: s for s in ckpt.ring.slots}
        assert set(slots) == {1, 2}  # no free slot: the next save takes over step 1's
        ahead = slots[1]
        assert ahead.buf is not None  # mapped ahead, its step untouched
        assert ahead.state is SlotState.COMMITTED and slots[2].buf is None
        assert ahead.index in {index for index, *_ in ckpt._mapped_slot_files()}
        ckpt.save(3, state).durable.result(30)
    with incluster.Checkpointer(local_dir=local_dir, job="ahead", keep=2, writer="thread") as ckpt:
        fresh = _state()
        assert ckpt.load(fresh) == 3
        assert torch.equal(fresh["w"].weight, state["w"].weight)
