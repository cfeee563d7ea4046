"""DTensor state on 2 ranks, saved by incluster, exported to DCP, loaded resharded.

    python dcp_script.py OUT_DIR        (2 ranks, launched by test_dcp.py)

Each rank holds ``w`` (7 x 6, Shard(0): uneven rows), ``b`` (Replicate) and a per-rank
``extra`` dict. incluster saves step 4 with a replica; rank 0 then runs
``incluster export --to dcp``; both ranks load that folder with ``load_dcp`` into a
Shard(1) layout (a different sharding) and check every element. Writes
``OUT_DIR/result-r{rank}.json`` and rank 0 leaves the export in ``OUT_DIR/dcp``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import incluster
from incluster.integrations.dcp import load_dcp

W = torch.arange(42, dtype=torch.float32).reshape(7, 6) / 7
B = torch.linspace(-1, 1, 6)


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    state = {"w": distribute_tensor(W.clone(), mesh, [Shard(0)]), "b": distribute_tensor(B.clone(), mesh, [Replicate()]),
             "extra": {"tokens": 1000 + rank, "name": "run"}}
    ck = incluster.Checkpointer(job="dcpx", replicas=1, slot_timeout_s=60)
    ck.save(4, state).wait()
    ck.close()
    dist.barrier()
    target = os.path.join(out_dir, "dcp")
    if rank == 0:
        base = os.path.dirname(os.environ["INCLUSTER_LOCAL_DIR"])
        dirs = [os.path.join(base, n) for n in ("n0", "n1")]
        proc = subprocess.run([sys.executable, "-m", "incluster", "export", *dirs, "--step", "4", "--to", "dcp", target],
                              capture_output=True, text=True, timeout=120)
        with open(os.path.join(out_dir, "export.txt"), "w") as f:
            f.write(f"{proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    dist.barrier()
    live = {"w": distribute_tensor(torch.zeros(7, 6), mesh, [Shard(1)]), "b": distribute_tensor(torch.zeros(6), mesh, [Replicate()]),
            "extra": {"tokens": -1, "name": ""}}
    load_dcp(live, target, step=4)
    res = {"w": bool(torch.equal(live["w"].full_tensor(), W)), "b": bool(torch.equal(live["b"].full_tensor(), B)),
           "local_w_shape": list(live["w"].to_local().shape), "extra": live["extra"]}
    with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
