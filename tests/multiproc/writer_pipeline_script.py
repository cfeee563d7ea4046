"""A writer process whose copies out of the device-side snapshot are stood in for on CPU.

    python writer_pipeline_script.py FD COPY_S

Runs the real writer loop (``incluster.writer.worker.serve``) on the socket ``FD``, with
``DeviceDrains`` replaced by a CPU stand-in that takes ``COPY_S`` seconds per copy (as a
GPU copy over PCIe would), writes a known pattern for the step into the slot through the
writer's own mapping, says DRAINED, and hands back the real chunk digests still being
hashed. Everything after the copy - digests, commit, messages, their order - is the
writer's own code. Used by tests/multiproc/test_writer_pipeline.py.
"""

from __future__ import annotations

import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from incluster.format.checksum import checksum_pool, digest
from incluster.writer import device_drain, worker


class CopyStandIn:
    def __init__(self, service: Any) -> None:
        self.service = service
        self.buf_id: int | None = None

    def open(self, buf_id: int, *_: Any) -> None:
        self.buf_id = buf_id

    def start(self, req: Any, copied: Any = None) -> list:
        buf_id, lo, runs = req.drain
        if buf_id != self.buf_id:
            raise RuntimeError(f"step {req.step}: the device-side snapshot {buf_id} is not open in the writer")
        mm = self.service.map_slot(str(req.slot), req.staging_path, req.size, populate=False, gen=req.maps)
        time.sleep(COPY_S)
        for a, b in runs:
            mm[a:b] = bytes([req.step % 251]) * (b - a)
        if copied is not None:
            copied()
        view = memoryview(mm)
        return [checksum_pool().submit(digest, view[k : min(req.size, k + req.chunk)])
                for k in range(0, req.size, req.chunk)]

    def close(self) -> None:
        pass


if __name__ == "__main__":
    COPY_S = float(sys.argv[2])
    device_drain.DeviceDrains = CopyStandIn  # type: ignore[misc,assignment]
    conn = Connection(int(sys.argv[1]))
    try:
        worker.serve(conn)
    finally:
        conn.close()
