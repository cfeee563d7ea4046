"""How long does recovery take? incluster's restore against the floors and dcp.load.

One run, 4 ranks (gloo on 127.0.0.1, 4 simulated nodes A-D, one rank each, replicas=1,
writer="thread"), ``--gib`` of float32 parameters per rank (default 1 GiB in 16,
held in a dict, so every restore copies into the live tensors in place). It measures:

  floor, 1 process      one ``copy_`` of the same bytes between two tensors that were
                        allocated and touched beforehand, in this process, machine idle
  floor, 4 ranks        the same copy on every rank at once (barrier-aligned; slowest
                        rank): the floor under the same oversubscription as a restore
  read floor            the same bytes read from a file in the RAM disk by ``preadv``
                        into touched memory, 4 ranks at once, nothing checked: what any
                        restore from a RAM-disk file pays at least (the kernel copies
                        out of the page cache 4 KiB page by page, ~1.5x a memcpy here)
  gloo pair alone       ``batch_isend_irecv`` of one ``--gib`` uint8 tensor from rank 0
                        to rank 1 (touched buffers; the other ranks idle)
  gloo, restore pattern the same, but the exact sender -> receiver pairs the peer restore
                        below uses (``make_plan`` on the scenario), all at once
  fresh /dev/shm slot   ``posix_fallocate`` + ``mmap(MAP_POPULATE)`` of a new ``--gib``
                        file on each receiving rank at once (what a receiver used to do
                        before its bytes could land; the gloo rows above receive into
                        reused memory)
  fresh file, pwrite    ``--gib`` written with plain ``pwrite`` into a new file on each
                        receiving rank at once: what a peer restore's heal costs now (the
                        bytes land in the live tensors; the receiver's node gets its copy
                        this way, no zeroing pass, no page-table population)
  incluster save        one ``save()`` until durable on every rank (the state restored
                        below; for reference)
  local restore         restart on the same nodes A,B,C,D: ``Checkpointer.load()``
                        reads each rank's shard from its own node's RAM disk
  peer restore          node B's folder wiped, restart on nodes C,E,A,D (spare E takes B's
                        place, A and C swap): every rank but rank 3 gets its shard from a
                        peer's RAM over gloo (and heals its own node's tier)
  dcp.load              ``torch.distributed.checkpoint.load`` of the same state from a DCP
                        folder in /dev/shm that the same 4 ranks saved (``dcp.save``) in
                        this run, right after the local restores (same processes)
  elastic               unless ``--no-elastic``: ``bench/recovery_reshard.py`` (the same
                        ``--gib``, 4 -> 3 ranks, FSDP2 DTensors, against ``dcp.load``
                        resharding the same state from the same RAM disk) and
                        ``bench/dp_share.py`` (replication bytes and RAM per node with
                        and without data-parallel sharing), each printing its ratios

Restore times are per rank and the slowest rank counts: ``report`` is the time ``load()``
itself measured (``ckpt.last_restore.seconds``), ``wall`` the time around the
``load()`` call measured here (both after a barrier). Every restore starts from zeroed
live tensors and is checked bitwise (xxh3-128 of every tensor against the digest taken
at save time) and in place (same ``data_ptr`` before and after). Local restores and
dcp.load run ``--repeats`` times in one job; each peer restore needs the wiped
cluster again, so it is one fresh job per repeat, with the folders put back to their
post-wipe state in between. One extra, profiled restore of each kind (cProfile of
every rank's ``load()``, left out of the medians) shows where the time goes.

Targets (issue 4): local restore <= 1.5x the floor; peer restore <= 2x what the same bytes
take through gloo send/recv alone. The local target is judged against the 4-rank floor
measured *paired*: right before each local restore the same 4 ranks copy the same bytes
into the same live tensors at once, and the ratio is taken per repeat (median), so a
busy moment slows both sides alike; the 4-rank floor of the earlier gloo job and the
1-process floor are shown for reference. The same pairing gives the read floor: the
ranks ``preadv`` their own shard files into those tensors, nothing checked. The peer
target is judged against the restore's own transfer pattern and, for reference, one pair.

Planner alone (no processes): ``make_plan`` for 16,384 simulated ranks on 2,048 nodes
(8 ranks per node, replicas=1, two steps held), with one node lost and a spare in its
place and four pairs of nodes swapped (median of ``--plan-runs``; target < 1 s), at a few
smaller sizes to show how it scales, with the bytes the inventory exchange moves: the
pickled per-node inventories, what the restore sends rank 0 for them (each rank its
length and its record, point to point: O(W); ``gather_object`` would pad every record to
the largest and all-gather W sizes to every rank, O(W^2), shown for comparison) and the
plan scatter.

Memory: peak is about 4 x (state + own shard + replica + DCP files) = 16 GiB at 1 GiB per
rank. The second (free, never read) slot file each rank pre-allocates after its first
save is removed between jobs so this fits in 24 GiB. Everything lives in one folder under
/dev/shm that is removed at the end, also on failure or SIGTERM.

    python bench/recovery.py                    # 1 GiB per rank; ~10-15 minutes on 2 cores
    python bench/recovery.py --quick            # 64 MiB per rank, a smoke run
    python bench/recovery.py --gib 0.5 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from typing import Any, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import floor_copy, human_size, loadavg, log, machine_info, scratch_dir  # noqa: E402 - bench/ is not a package
from recovery_planner import placement_cost, planner_case  # noqa: E402
from recovery_ranks import STEP, worker  # noqa: E402
from recovery_report import mount_options, print_report, summarise  # noqa: E402

NODES = ["A", "B", "C", "D"]
WIPED = "B"
AFTER = ["C", "E", "A", "D"]  # spare E takes B's place; A and C swap positions


def scenario_holdings(nodes: Sequence[str], replicas: int) -> dict[str, list[tuple[int, int]]]:
    """What each node's RAM folder holds after one save of STEP on ``nodes`` (one rank
    per node): its own rank's shard and the replicas placed on it."""
    from incluster.topology import Topology, replica_targets

    topo = Topology.from_nodes(list(nodes))
    held: dict[str, list[tuple[int, int]]] = {n: [] for n in nodes}
    for r in range(topo.world_size):
        held[topo.node_of[r]].append((r, STEP))
        for t in replica_targets(topo, r, replicas):
            held[topo.node_of[t]].append((r, STEP))
    return held


def expected_pattern(before: Sequence[str], after: Sequence[str], wiped: str) -> list[tuple[int, int]]:
    """(source rank, receiving rank) pairs the restore after the swap should use."""
    from incluster.recovery.plan import make_plan
    from incluster.topology import Topology

    held = scenario_holdings(before, 1)
    held.pop(wiped, None)
    plan = make_plan(Topology.from_nodes(list(after)), held)
    return [(p.source, r) for r, p in enumerate(plan.ranks) if p.source is not None]


def run_job(base: str, tag: str, phase: str, nodes: Sequence[str], cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    from incluster.testing.launch import launch

    results = os.path.join(base, "results")
    os.makedirs(results, exist_ok=True)
    full = {**cfg, "phase": phase, "tag": tag, "results": results, "base": base}
    log(f"[{tag}] {phase} on nodes {','.join(nodes)} (load {loadavg()})")
    t0 = time.monotonic()
    job = launch(
        [os.path.abspath(__file__), "--_worker", json.dumps(full)],
        nodes=list(nodes),
        ranks_per_node=1,
        base_dir=base,
        env={"OMP_NUM_THREADS": str(cfg["threads"]), "PYTHONWARNINGS": "ignore"},
    )
    failed_at = None
    try:
        while True:
            codes = [p.poll() for p in job.procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > 5:  # give the others a moment to report
                    break
            if time.monotonic() - t0 > timeout:
                failed_at = failed_at or time.monotonic()
                log(f"[{tag}] still running after {timeout:.0f} s: killing the job")
                break
            time.sleep(0.25)
    finally:
        job.kill_all()
    codes = [p.returncode for p in job.procs]
    out = []
    for r in range(len(job.procs)):
        p = os.path.join(results, f"{tag}-r{r}.json")
        if os.path.exists(p):
            with open(p) as f:
                out.append(json.load(f))
    errors = [o for o in out if o.get("error")]
    if any(codes) or len(out) != len(job.procs) or errors:
        detail = errors[0]["error"] if errors else job.output(next((r for r, c in enumerate(codes) if c), 0))[-4000:]
        raise RuntimeError(f"[{tag}] {phase} failed: exit codes {codes}\n{detail}")
    log(f"[{tag}] done in {time.monotonic() - t0:.1f} s")
    return sorted(out, key=lambda o: o["rank"])


def remove_free_slots(base: str) -> int:
    """Unlink ``.staging-*`` slot files: free slots that hold no committed step (a restore
    never reads them); done only so the run fits the machine's RAM."""
    freed = 0
    for root, _dirs, files in os.walk(base):
        for n in files:
            if n.startswith(".staging-"):
                p = os.path.join(root, n)
                freed += os.path.getsize(p)
                os.unlink(p)
    return freed


def snapshot(base: str, nodes: Sequence[str]) -> dict[str, int]:
    snap = {}
    for node in nodes:
        top = os.path.join(base, node)
        for root, dirs, files in os.walk(top):
            for n in dirs:
                snap[os.path.join(root, n)] = -1
            for n in files:
                p = os.path.join(root, n)
                snap[p] = os.path.getsize(p)
    return snap


def reset_to(base: str, nodes: Sequence[str], snap: dict[str, int]) -> None:
    """Put the node folders back to ``snap``: remove what a restore added (healed copies,
    new folders); the files in ``snap`` are only ever read by a restore."""
    for node in nodes:
        top = os.path.join(base, node)
        if not os.path.isdir(top):
            continue
        for root, dirs, files in os.walk(top, topdown=False):
            for n in files:
                p = os.path.join(root, n)
                if p not in snap:
                    os.unlink(p)
                elif snap[p] != os.path.getsize(p):
                    raise RuntimeError(f"{p} changed size during a restore")
            for n in dirs:
                p = os.path.join(root, n)
                if p not in snap:
                    shutil.rmtree(p)
        if top not in snap and not any(k.startswith(top + os.sep) for k in snap):
            shutil.rmtree(top, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=None, help="state per rank in GiB (default 1.0; --quick: 1/16)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks (only 4 is supported: the scenario is A-D + spare E)")
    ap.add_argument("--tensors", type=int, default=16, help="float32 tensors per rank (default 16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats of each measurement (default 3; --quick: 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cpus // ranks, >= 1)")
    ap.add_argument("--plan-runs", type=int, default=None, help="make_plan runs per size (default 5; --quick: 3)")
    ap.add_argument("--no-profile", action="store_true", help="skip the extra profiled restores")
    ap.add_argument("--no-dcp", action="store_true", help="skip dcp.save/dcp.load")
    ap.add_argument("--skip-planner", action="store_true")
    ap.add_argument("--no-elastic", action="store_true",
                    help="skip the elastic part (bench/recovery_reshard.py 4 -> 3 ranks vs dcp.load, bench/dp_share.py)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per job before it is killed (default 1200)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke run")
    ap.add_argument("--ram-disk", default="/dev/shm", metavar="DIR",
                    help="the RAM disk the nodes' folders live in (default /dev/shm); e.g. a tmpfs mounted "
                         "with huge=within_size, see the README")
    ap.add_argument("--json", metavar="OUT", help="also write every sample and the summary as JSON to OUT")
    ap.add_argument("--from-json", metavar="IN", help="print the report of an earlier --json run; measure nothing")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        return worker(json.loads(args._worker))
    if args.from_json:
        with open(args.from_json) as f:
            R = json.load(f)
        print_report(R, summarise(R))
        return 0
    if args.ranks != 4:
        ap.error("--ranks: the recovery scenario (nodes A-D, spare E, A and C swap) is defined for 4 ranks")
    gib = args.gib if args.gib is not None else (1 / 16 if args.quick else 1.0)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    plan_runs = args.plan_runs if args.plan_runs is not None else (3 if args.quick else 5)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.ranks)
    nbytes = int(gib * (1 << 30)) // 4096 * 4096
    timeout = args.timeout or (300.0 if args.quick else 1200.0)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks clean up
    pattern = expected_pattern(NODES, AFTER, WIPED)
    if not os.path.isdir(args.ram_disk):
        ap.error(f"--ram-disk {args.ram_disk}: no such folder")
    cfg = {
        "ram_disk": args.ram_disk,
        "ram_disk_mount": mount_options(args.ram_disk),
        "bytes": nbytes, "tensors": args.tensors, "repeats": repeats, "threads": threads, "ranks": args.ranks,
        "timeout_s": timeout, "pattern": pattern, "profile": not args.no_profile, "dcp": not args.no_dcp,
        "peer_runs": repeats, "plan_runs": plan_runs,
    }
    R: dict[str, Any] = {"config": cfg, "machine": machine_info(), "load_start": loadavg(), "profiles": {}}
    try:
        import psutil

        need = nbytes * args.ranks * 4.5 + (2 << 30)
        avail = psutil.virtual_memory().available
        if avail < need:
            log(f"needs about {need / 2**30:.1f} GiB of free RAM, {avail / 2**30:.1f} GiB available: "
                f"use a smaller --gib")
            return 2
    except ImportError:
        pass
    t_start = time.monotonic()
    try:
        # 1. what a single process can do, machine idle
        torch.set_num_threads(threads)
        log(f"floor: copy_ of {human_size(nbytes)} into reused memory, {threads} thread(s)")
        R["floor_1proc_s"] = floor_copy(nbytes, max(3, repeats))
        if not args.skip_planner:
            log("planner: make_plan at 2,048 / 4,096 / 16,384 ranks")
            cases = [planner_case(w, 8, plan_runs, check_placement=(w == 2048)) for w in (2048, 4096, 16384)]
            R["planner"] = {"cases": cases, "placement": placement_cost(16384, 8)}
        with scratch_dir("incluster-bench-recovery-", root=args.ram_disk) as base:
            cfg["dcp_dir"] = os.path.join(base, "dcp")
            # 2. the transport alone, and the floor with 4 ranks at once
            R["gloo"] = run_job(base, "gloo", "gloo", NODES, cfg, timeout)
            # 3. one save on A-D
            R["save"] = run_job(base, "save", "save", NODES, cfg, timeout)
            cfg["digests"] = [r["digest"] for r in R["save"]]
            R["free_slots_removed_bytes"] = remove_free_slots(base)
            # 4. restart on the same nodes: local restores, then dcp.save/load by the same ranks
            R["local"] = run_job(base, "local", "local", NODES, cfg, timeout)
            if R["local"][0]["restores"][-1].get("profiled"):
                R["profiles"]["local"] = {"rank": 0, **R["local"][0]["restores"][-1]["profile"]}
            shutil.rmtree(cfg["dcp_dir"], ignore_errors=True)
            remove_free_slots(base)
            # 5. node B lost; spare E in its place; A and C swapped
            shutil.rmtree(os.path.join(base, WIPED))
            snap = snapshot(base, NODES + AFTER)
            R["peer"] = []
            runs = repeats + (0 if args.no_profile else 1)
            for k in range(runs):
                reset_to(base, sorted(set(NODES + AFTER)), snap)
                prof = not args.no_profile and k == runs - 1
                ranks = run_job(base, f"peer{k}", "peer", AFTER, {**cfg, "profile": prof}, timeout)
                R["peer"].append({"profiled": prof, "ranks": [{"rank": r["rank"], **r["restores"][0]} for r in ranks]})
                if prof:
                    # the rank that both sends and receives, if any, else the first receiver
                    srcs = {s for s, _ in pattern}
                    pick = next((d for s, d in pattern if d in srcs), pattern[0][1] if pattern else 0)
                    R["profiles"]["peer"] = {"rank": pick, **ranks[pick]["restores"][0]["profile"]}
    except BaseException as exc:
        R["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {R['error'][:6000]}")
        if not isinstance(exc, Exception):
            raise
    R["total_s"] = time.monotonic() - t_start
    R["load_end"] = loadavg()
    S = summarise(R)
    R["summary"] = S
    print_report(R, S)
    if not args.no_elastic and not R.get("error"):
        R["elastic"] = run_elastic(gib, args.quick, args.timeout)
        if any("error" in v for v in R["elastic"].values()):
            R["error"] = "elastic: " + "; ".join(f"{k}: {v['error']}" for k, v in R["elastic"].items() if "error" in v)
    print(f"\nload average {R['load_start']} -> {R['load_end']}; total {R['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(R, f, indent=1, default=str)
    return 1 if R.get("error") else 0


def run_elastic(gib: float, quick: bool, timeout: float | None) -> dict[str, Any]:
    """The elastic restores, each bench in its own processes (it prints its own report and
    ratios): resharding 4 -> 3 ranks against dcp.load from the same RAM disk, and the
    replication bytes and RAM per node with and without data-parallel sharing."""
    import subprocess
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    runs = {
        "reshard": ["recovery_reshard.py", "--gib", str(gib)] + (["--quick"] if quick else [])
        + (["--timeout", str(timeout)] if timeout else []),
        "dp_share": ["dp_share.py", "--mib", str(16 if quick else 256)] + (["--saves", "1"] if quick else []),
    }
    out: dict[str, Any] = {}
    for name, cmd in runs.items():
        log(f"elastic: {' '.join(cmd)}")
        with tempfile.TemporaryDirectory(prefix="incluster-bench-elastic-") as tmp:
            path = os.path.join(tmp, "out.json")
            rc = subprocess.call([sys.executable, os.path.join(here, cmd[0]), *cmd[1:], "--json", path])
            try:
                with open(path) as f:
                    out[name] = json.load(f) if rc == 0 else {"error": f"{cmd[0]} exited {rc}"}
            except (OSError, ValueError) as exc:
                out[name] = {"error": f"{cmd[0]} exited {rc} and wrote no report ({exc})"}
    return out


if __name__ == "__main__":
    sys.exit(main())
