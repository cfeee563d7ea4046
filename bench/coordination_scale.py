"""What does coordinating a save cost as the job grows? incluster against DCP.

For each world size (default 2, 4, 8, 16 processes; gloo on 127.0.0.1; one simulated node
per rank) it launches the ranks once and, in that one job, saves a tiny state (default
8 KiB in 16 tensors per rank, distinct names per rank like a fully sharded model) with:

  incluster (thread)      Checkpointer(writer="thread"): the commit and the store client
                          run on threads of the rank's own process
  incluster (process)     Checkpointer(writer="process"), the default: one writer process
                          per rank holds the store clients (doubles the process count)
  incluster (1 replica)   thread writer with replicas=1 (when the installed incluster has
                          the option): each shard is also sent to a rank on another node,
                          peer to peer over the writers' own gloo group. That traffic is
                          data (the shard and its sidecar), not coordination; it is shown
                          so the two can be told apart. The rows above use replicas=0.
  dcp.save                torch.distributed.checkpoint.save to /dev/shm
  dcp.save +cache         the same with DefaultSavePlanner(enable_plan_caching=True)
  dcp.async_save          thread executor, default stager
  dcp.async_save +cache   the same with plan caching

Per save it reports

  msgs @rank0, KiB @rank0 TCP data segments and payload bytes (in + out) on rank 0's
                          sockets, read from the kernel (``ss -ti``: data_segs_in/out,
                          bytes_received/bytes_sent) before and after the save. incluster:
                          the job store's server side (it lives in rank 0's process, so
                          every store request of every rank is here) plus rank 0's gloo
                          sockets (none are used). DCP: rank 0's gloo sockets.
  msgs/rank, KiB/rank     the same for the busiest other rank's own sockets (its store
                          client connections, in its writer process too, and its gloo
                          sockets): the per-rank cost.
  ops/rank                the coordination calls one rank makes (max over ranks):
                          incluster store operations (counted by wrapping the TCPStore
                          client the StoreCoordinator uses; thread writer only), DCP
                          object collectives (wrapping the torch.distributed functions
                          that torch/distributed/checkpoint/utils.py ``_DistWrapper``
                          calls) with, in brackets, the tensor collectives under them.
  coord ms med / max      time spent coordinating. incluster: from the rank's local commit
                          to its learning the global outcome (store add, outcome wait;
                          with a replica also the replica exchange);
                          DCP: time inside the object collectives (the planning gather and
                          scatter, the write-result gather and metadata broadcast). Both
                          include waiting for the slowest rank. med: over all ranks and
                          saves; max: median over saves of the slowest rank.
  save() ms               how long the call blocks the trainer (median over ranks, saves).
  durable ms              until the save is complete on every rank (median over saves of
                          the slowest rank).

The incluster store is hosted by rank 0, so "@rank0" for incluster is the whole job's
store traffic and grows with W by construction; what stays flat is each rank's share.
The JSON also records open connections (rank 0's store server side, one rank's store
client and gloo connections) and every store operation of the thread writer by key.

Not counted: the setup traffic (process group, the incluster constructor's one exchange
of the store address and replica partners) and the benchmark's own synchronisation between saves, which runs
over the default process group's TCPStore (its port is excluded from the counts).
Before each save every rank waits for all ranks to be ready (so saves start together);
after it every rank waits for all ranks to finish (so the counters see the whole save).

On a small machine the larger sizes oversubscribe the cores heavily (16 ranks, and for
the process writer 16 writer processes too, on 2 cores; ``--writer thread`` skips it): times there measure scheduling
as much as coordination; the message and byte counts do not depend on it.

    python bench/coordination_scale.py                        # 2,4,8,16; ~4 minutes on 2 cores
    python bench/coordination_scale.py --quick                # 2,4; a smoke run
    python bench/coordination_scale.py --sizes 2,8 --saves 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import loadavg, log, machine_info, parse_size, scratch_dir  # noqa: E402 - bench/ is not a package
from coordination_scale_ranks import ALL_SYSTEMS, INCLUSTER_SYSTEMS, incluster_has_replicas, worker  # noqa: E402
from coordination_scale_report import print_growth, print_table, summarise  # noqa: E402


def run_world(world: int, systems: list[str], args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    from incluster.testing.launch import launch

    with scratch_dir(f"incluster-coord-w{world}-") as base:
        cfg = {
            "base_dir": base,
            "systems": systems,
            "saves": args.saves,
            "warmup": args.warmup,
            "state_bytes": args.state_bytes,
            "tensors": args.tensors,
        }
        t0 = time.monotonic()
        job = launch(
            [os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
            nodes=[f"n{i}" for i in range(world)],
            ranks_per_node=1,
            base_dir=base,
            env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        )
        try:
            codes = job.wait(timeout)
        except BaseException:
            job.kill_all()
            raise
        finally:
            job.kill_all()  # no-op when all exited; never leaves a rank behind
        results = []
        for r in range(world):
            p = os.path.join(base, f"result-{r}.json")
            if os.path.exists(p):
                with open(p) as f:
                    results.append(json.load(f))
        bad = [r for r, c in enumerate(codes) if c != 0]
        if bad or len(results) != world:
            tail = job.output(bad[0] if bad else 0)[-3000:]
            raise RuntimeError(f"world {world}: ranks {bad} exited {[codes[r] for r in bad]}; rank log tail:\n{tail}")
        return {"world": world, "wall_s": time.monotonic() - t0, "ranks": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma-separated world sizes (default 2,4,8,16; --quick: 2,4)")
    ap.add_argument("--saves", type=int, default=None, help="measured saves per system (default 8; --quick: 3)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up saves per system, left out (default 2)")
    ap.add_argument("--state", default="8K", help="state bytes per rank (default 8K)")
    ap.add_argument("--tensors", type=int, default=16, help="tensors per rank (default 16)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"subset of {','.join(ALL_SYSTEMS)}")
    ap.add_argument("--writer", choices=["thread", "process", "both"], default="both",
                    help="which incluster writer(s) to run (default both; 'thread' halves the process count)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per world size before giving up (default 900)")
    ap.add_argument("--quick", action="store_true", help="2 and 4 ranks, few saves: a smoke run")
    ap.add_argument("--json", metavar="OUT", help="also write every sample and the summary as JSON to OUT")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._worker:
        worker(json.loads(args._worker))
        return 0
    # A plain `kill` must still remove the scratch folders in /dev/shm (finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if shutil.which("ss") is None:
        log("coordination_scale: needs `ss` (iproute2) to read per-socket TCP counters")
        return 2
    sizes = [int(x) for x in (args.sizes or ("2,4" if args.quick else "2,4,8,16")).split(",") if x.strip()]
    if any(w < 2 for w in sizes):
        ap.error("world sizes must be >= 2 (coordination needs peers)")
    args.saves = args.saves if args.saves is not None else (3 if args.quick else 8)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    args.state_bytes = parse_size(args.state)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ALL_SYSTEMS:
            ap.error(f"unknown system {s!r}; choose from {','.join(ALL_SYSTEMS)}")
    if args.writer != "both":
        systems = [s for s in systems if s not in INCLUSTER_SYSTEMS or INCLUSTER_SYSTEMS[s][0] == args.writer]
    if "incluster-thread+replica" in systems and not incluster_has_replicas():
        log("coordination_scale: this incluster has no `replicas` option; skipping incluster-thread+replica")
        systems.remove("incluster-thread+replica")
    timeout = args.timeout or 900.0

    info = machine_info()
    log(f"coordination_scale: sizes {sizes}, {args.saves} saves (+{args.warmup} warm-up) per system, "
        f"state {args.state_bytes} B in {args.tensors} tensors per rank; {info['cpus']} CPUs, torch {info['torch']}")
    report: dict[str, Any] = {"machine": info, "config": {
        "sizes": sizes, "saves": args.saves, "warmup": args.warmup, "state_bytes": args.state_bytes,
        "tensors": args.tensors, "systems": systems}, "worlds": [], "summary": []}
    rows: list[dict[str, Any]] = []
    for world in sizes:
        log(f"world {world}: launching {world} ranks (load {loadavg()})")
        try:
            res = run_world(world, systems, args, timeout)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other sizes
            log(f"world {world}: failed: {exc}")
            rows.append({"world": world, "system": systems[0], "error": str(exc)})
            report["worlds"].append({"world": world, "error": str(exc)})
            continue
        log(f"world {world}: done in {res['wall_s']:.0f} s")
        report["worlds"].append(res)
        rows.extend(summarise(res, systems, args.warmup))

    print()
    print(f"Save-time coordination per save, tiny state ({args.state_bytes} B in {args.tensors} tensors per rank), "
          f"gloo on 127.0.0.1, {info['cpus']} CPUs, torch {info['torch']}; medians over {args.saves} saves.")
    print("msgs/KiB: TCP data segments and payload bytes in+out, from the kernel's socket counters. "
          "@rank0: rank 0's process (incluster: the job store's server side, every rank's store traffic; "
          "DCP: rank 0's gloo sockets). /rank: the busiest other rank's own sockets. ops/rank: store operations "
          "(incluster) or object collectives (tensor collectives) per rank (DCP).\n")
    table = print_table(rows)
    print_growth(rows)
    report["summary"] = rows
    report["table"] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
