"""Replication bytes and RAM per node with and without data-parallel sharing.

4 ranks on 4 simulated nodes (gloo on 127.0.0.1, one rank each, replicas=1), every
rank holding the same ``--mib`` MiB of float32 tensors (what data parallelism keeps
identical) plus a value of its own. Each configuration saves ``--saves`` steps, each
until durable, once with ``share_replicas=True`` (the default) and once with False, in
the same run. Measured per configuration:

  loopback bytes   bytes through the ``lo`` interface while the saves ran
                   (/proc/net/dev, receive side): replication is the only bulk
                   traffic in this job (no collectives run while saving)
  RAM per node     bytes of files in each node's RAM folder after the last save
  durable          median time from ``save()`` to durable (rank 0)

    .venv/bin/python bench/dp_share.py [--mib 256] [--saves 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NODES = ["n0", "n1", "n2", "n3"]


def lo_rx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    return 0


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for n in files:
            try:
                total += os.stat(os.path.join(root, n)).st_size
            except FileNotFoundError:
                pass
    return total


def worker(out: str, mib: int, saves: int, share: bool) -> int:
    import torch
    import torch.distributed as dist

    import incluster

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    n = mib * (1 << 20) // 4 // 8
    state = {"w": {f"t{i}": torch.randn(n) for i in range(8)}, "own": {"rank": rank}}
    ck = incluster.Checkpointer(job="dpshare-bench", replicas=1, share_replicas=share, slot_timeout_s=300)
    times = []
    try:
        for step in range(1, saves + 1):
            for t in state["w"].values():
                t.add_(1.0)
            dist.barrier()
            if rank == 0:
                with open(os.path.join(out, f"lo-{step}-start"), "w") as f:
                    f.write(str(lo_rx()))
            t0 = time.perf_counter()
            ck.save(step, state).wait(600)
            times.append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0:
                with open(os.path.join(out, f"lo-{step}-end"), "w") as f:
                    f.write(str(lo_rx()))
    finally:
        ck.close()
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()
    return 0


def run(mib: int, saves: int, share: bool) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    from incluster.testing.launch import launch

    base = tempfile.mkdtemp(prefix="incluster-bench-dpshare-", dir="/dev/shm")
    try:
        out = os.path.join(base, "out")
        os.makedirs(out)
        job = launch([__file__, "--_worker", out, str(mib), str(saves), str(int(share))], nodes=NODES,
                     ranks_per_node=1, base_dir=base)
        codes = job.wait(1800)
        if codes != [0] * 4:
            raise RuntimeError(f"ranks failed: {codes}: {job.output(0)[-2000:]}")
        lo = [int(open(os.path.join(out, f"lo-{s}-end")).read()) - int(open(os.path.join(out, f"lo-{s}-start")).read())
              for s in range(1, saves + 1)]
        times = json.load(open(os.path.join(out, "times.json")))
        ram = {n: folder_bytes(os.path.join(base, n)) for n in NODES}
        return {"share_replicas": share, "loopback_bytes_per_save": lo, "ram_per_node": ram,
                "durable_median_s": statistics.median(times), "durable_s": times}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        out, mib, saves, share = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5]))
        return worker(out, mib, saves, share)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state per rank in MiB (default 256)")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    results = [run(args.mib, args.saves, share) for share in (True, False)]
    shared, full = results
    print(f"# data-parallel sharing: 4 ranks x {args.mib} MiB identical state, replicas=1, {args.saves} saves each")
    print(f"{'':34}{'shared':>16}{'not shared':>16}{'ratio':>8}")
    lo_s, lo_f = statistics.median(shared["loopback_bytes_per_save"]), statistics.median(full["loopback_bytes_per_save"])
    print(f"{'loopback bytes per save (median)':34}{lo_s:>16,.0f}{lo_f:>16,.0f}{lo_s / max(lo_f, 1):>8.3f}")
    for n in NODES:
        a, b = shared["ram_per_node"][n], full["ram_per_node"][n]
        print(f"{'RAM on ' + n + ', bytes':34}{a:>16,}{b:>16,}{a / max(b, 1):>8.3f}")
    a, b = shared["durable_median_s"], full["durable_median_s"]
    print(f"{'durable, median s':34}{a:>16.3f}{b:>16.3f}{a / b:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "saves": args.saves, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
