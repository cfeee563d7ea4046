"""Rank 1 announces a record of a terabyte to rank 0's gather; run by test_hostile_peer.py.

    python hostile_peer_script.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from incluster.recovery.gather import gather_to_zero, scatter_from_zero


def main() -> int:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = "no error"
    if rank == 1:
        dist.send(torch.tensor([1 << 40], dtype=torch.int64), 0)  # a length, and nothing behind it
        got = scatter_from_zero(None, 1, 2)  # the next exchange still works
        result = f"scatter {got}"
    else:
        try:
            gather_to_zero({"node": "n0"}, 0, 2)
        except ValueError as exc:
            result = f"refused: {exc}"
        scatter_from_zero([{"to": 0}, {"to": 1}], 0, 2)
    with open(os.path.join(out, f"r{rank}.txt"), "w") as f:
        f.write(result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
