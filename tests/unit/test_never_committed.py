"""Which rank folders prove that a rank never committed a step (a crash in a job's first
save), and which do not: a restore may start afresh only on such proof."""

from __future__ import annotations

import os
import time

from incluster.recovery.node import FOLDER, node_inventory


def _folder(local_dir: str, rank: int, *names: str, age_s: float = 60.0) -> None:
    folder = os.path.join(local_dir, "job", f"rank-{rank:05d}")
    os.makedirs(folder, exist_ok=True)
    then = time.time() - age_s
    for name in names:
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(b"x")
        os.utime(path, (then, then))


def _never_committed(local_dir: str, since: float) -> list[int]:
    return sorted(i[0] for i in node_inventory(local_dir, "job", since) if i[1] == FOLDER)


def test_only_an_earlier_runs_uncommitted_slots_count(local_dir):
    _folder(local_dir, 0, ".staging-0")  # a crash before the first commit: counts
    _folder(local_dir, 1, ".staging-0", "step-000000000005.safetensors")  # renamed, record not yet written: counts
    _folder(local_dir, 2, ".staging-1", "step-000000000005.json.bad")  # a bad copy set aside: a step was committed
    _folder(local_dir, 3, ".staging-0", "step-000000000004.json")  # an old committed step (a rank moved here)
    _folder(local_dir, 4, ".staging-0", age_s=-5)  # this run's own prepare() before load(): no proof
    assert _never_committed(local_dir, time.time()) == [0, 1]
