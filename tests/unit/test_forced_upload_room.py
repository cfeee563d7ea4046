"""A save(persist=True) made while an upload runs waits for it with its slot held; the
running upload holds the tier's slot and the newest step its own, so with keep=2 no slot
was left: the next save waited for the slow upload (up to slot_timeout_s, then failed,
advising to save less often). A slot is made beside such a waiting upload instead."""

from __future__ import annotations

import torch

import incluster
from incluster.testing.tiers import SlowTier
from incluster.tiers.persistent import FsspecTier


def test_a_save_after_a_forced_upload_waiting_behind_a_slow_one_gets_a_slot(local_dir, tmp_path):
    tier = SlowTier(FsspecTier(str(tmp_path / "tier")), latency_s=0.8)  # every tier call: 0.8 s
    state = {"w": torch.zeros(1024)}
    with incluster.Checkpointer(local_dir=local_dir, job="forced", writer="thread", persistent=tier,
                                persistent_every=1000, slot_timeout_s=0.5) as ck:
        handles = []
        for step in range(6):  # step 0's upload runs for many seconds; step 3 is forced behind it
            state["w"].fill_(float(step))
            handles.append(ck.save(step, state, persist=True if step == 3 else None))
            handles[-1].wait(30)  # each durable: no slot wait may fail a save
        assert len(ck.ring.slots) <= ck.ring.keep + 1  # one slot beside the waiting upload, no more
        assert [h.durable.exception() for h in handles] == [None] * 6
        assert handles[3].persisted.result(120) is True
        for step in (6, 7):  # the uploads are over: the slot made beside them goes at the next retention
            ck.save(step, state).wait(30)
        assert len(ck.ring.slots) == ck.ring.keep
