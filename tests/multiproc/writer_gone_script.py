"""Rank 1's writer process keeps dying until it is not started again; both ranks save on.

    python writer_gone_script.py   (2 ranks, 2 nodes, replicas=1)

Rank 1 kills its writer ``MAX_WRITER_RESTARTS + 1`` times after step 0, so its later
save()s raise WriterProcessDied (caught: the loop goes on). Rank 0 saves steps 1..6 and
prints, per step, how long the failure took and its message, then how many of its
WARNING records were about them.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import torch.distributed as dist

import incluster
from incluster.saving import MAX_WRITER_RESTARTS


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen = Count()
    logging.getLogger("incluster").addHandler(seen)
    logging.getLogger("incluster").setLevel(logging.INFO)
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    ck = incluster.Checkpointer(job="gone", replicas=1, slot_timeout_s=60)
    ck.save(0, state).wait(60)
    if rank == 1:
        for kill in range(MAX_WRITER_RESTARTS + 1):
            pid = ck.writer_pid
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while kill < MAX_WRITER_RESTARTS and ck.writer_pid in (pid, None) and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(1.0)  # the last death is seen (no successor is started)
    dist.barrier()
    for step in range(1, 7):
        t0 = time.monotonic()
        try:
            ck.save(step, state).wait(60)
            print(f"step {step} DURABLE", flush=True)
        except incluster.CheckpointError as exc:
            print(f"step {step} FAILED after {time.monotonic() - t0:.1f} s: {type(exc).__name__}: {exc}", flush=True)
    dist.barrier()
    warned = [r for r in seen.records if r.levelno >= logging.WARNING and "is not saved" not in r.getMessage()
              and ("gone for good" in r.getMessage() or "not started again" in r.getMessage())]
    print(f"WARNINGS {len(warned)}", flush=True)
    ck.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
