"""How long does recovery take? incluster's restore against the floors and dcp.load.

One run, 4 ranks (gloo on 127.0.0.1, 4 simulated nodes A-D, one rank each, replicas=1,
writer="thread"), ``--gib`` of float32 parameters per rank (default 1 GiB in 16,
held in a dict, so every restore copies into the live tensors in place). It measures:

  floor, 1 process      one ``copy_`` of the same bytes between two tensors that were
                        allocated and touched beforehand, in this process, machine idle
  floor, 4 ranks        the same copy on every rank at once (barrier-aligned; slowest
                        rank): the floor under the same oversubscription as a restore
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
(the same 4 processes on the same cores at once) and, for reference, the 1-process floor;
the peer target against the restore's own transfer pattern and, for reference, one pair.

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
import cProfile
import dataclasses
import datetime
import io
import json
import logging
import mmap
import os
import pickle
import pstats
import shutil
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402 - bench/ is not a package
    floor_copy,
    human_size,
    loadavg,
    log,
    machine_info,
    markdown_table,
    median,
    scratch_dir,
)

JOB = "bench"
STEP = 1
NODES = ["A", "B", "C", "D"]
WIPED = "B"
AFTER = ["C", "E", "A", "D"]  # spare E takes B's place; A and C swap positions
LOCAL_TARGET = 1.5
PEER_TARGET = 2.0
PLAN_TARGET_S = 1.0
GB = 1e9


# =========================================================================================
# Small helpers (both sides)
# =========================================================================================


def digest(tensors: Sequence[torch.Tensor]) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def build_state(nbytes: int, n: int, seed: int | None) -> dict[str, Any]:
    """``{"model": {name: float32 parameter}}`` holding ``nbytes``; every page written once.
    ``seed`` None: zeros (a live model waiting to be restored into). Parameters, as in a
    model: a peer restore's background heal reads them in place (the optimizer pre-step
    hook guards them); plain tensors, which anything may change, it would copy aside first."""
    numel = nbytes // 4
    if n < 1 or numel < n:
        raise ValueError(f"cannot split {nbytes} bytes into {n} float32 tensors")
    counts = [numel // n] * n
    counts[-1] += numel - sum(counts)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    model: dict[str, torch.Tensor] = {}
    for i, c in enumerate(counts):
        shape = (c // 1024, 1024) if c % 1024 == 0 and c >= 4096 else (c,)
        t = torch.empty(shape, dtype=torch.float32)
        if gen is None:
            t.zero_()
        else:
            t.uniform_(-1.0, 1.0, generator=gen)
        model[f"layers.{i:02d}.weight"] = torch.nn.Parameter(t, requires_grad=False)
    return {"model": model}


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    return list(state["model"].values())


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / GB if seconds else None


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


# =========================================================================================
# Worker: one rank of a job (launched by incluster.testing.launch)
# =========================================================================================


def _barrier_time(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _profile_summary(prof: cProfile.Profile, top: int = 18) -> dict[str, Any]:
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(top)
    funcs = []
    for (file, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if "incluster" in file or name in ("copy_", "batch_isend_irecv", "wait", "gather_object", "scatter_object_list",
                                           "preadv", "pwritev"):
            short = file.split("incluster/", 1)[-1] if "incluster" in file else os.path.basename(file)
            funcs.append({"func": f"{short}:{line}({name})",
                          "ncalls": nc, "tottime": tt, "cumtime": ct})
    funcs.sort(key=lambda f: -f["cumtime"])
    return {"text": s.getvalue(), "funcs": funcs[:30]}


def _restore_once(cfg: dict[str, Any], state: dict[str, Any], expected: str, profile: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import incluster

    ptrs = [t.data_ptr() for t in tensors_of(state)]
    for t in tensors_of(state):
        t.zero_()
    t0 = time.perf_counter()
    ckpt = incluster.Checkpointer(job=JOB, writer="thread", replicas=1, slot_timeout_s=cfg["timeout_s"])
    ctor_s = time.perf_counter() - t0
    prof = cProfile.Profile() if profile else None
    dist.barrier()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    step = ckpt.load(state)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    rep = ckpt.last_restore
    t1 = time.perf_counter()
    ok = digest(tensors_of(state)) == expected
    hash_s = time.perf_counter() - t1
    in_place = [t.data_ptr() for t in tensors_of(state)] == ptrs
    t1 = time.perf_counter()
    ckpt.close()  # drains the background re-replication (the heal)
    close_s = time.perf_counter() - t1
    out = {
        "step": step,
        "report": dataclasses.asdict(rep) if rep is not None else None,
        "line": rep.line() if rep is not None else None,
        "wall_s": wall,
        "ctor_s": ctor_s,
        "close_s": close_s,
        "hash_s": hash_s,
        "bitwise": ok,
        "in_place": in_place,
        "profiled": profile,
    }
    if prof is not None:
        out["profile"] = _profile_summary(prof)
    return out


def phase_gloo(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    n = cfg["bytes"]
    reps = cfg["repeats"]
    send = torch.empty(n, dtype=torch.uint8)
    send.fill_(rank + 1)
    recv = torch.empty(n, dtype=torch.uint8)
    recv.fill_(0)
    out: dict[str, Any] = {}
    out["floor_s"] = [_barrier_time(lambda: recv.copy_(send)) for _ in range(reps + 1)][1:]

    def p2p(pairs: list[tuple[int, int]]) -> None:
        ops = []
        for src, dst in pairs:
            if dst == rank:
                ops.append(dist.P2POp(dist.irecv, recv, src))
            if src == rank:
                ops.append(dist.P2POp(dist.isend, send, dst))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    pair = [(0, 1)]
    pattern = [tuple(p) for p in cfg["pattern"]]
    out["pair_s"] = [_barrier_time(lambda: p2p(pair)) for _ in range(reps + 1)][1:]
    out["pair_ok"] = rank != 1 or bool((recv[:: max(1, n // 4096)] == 1).all())
    out["pattern_s"] = [_barrier_time(lambda: p2p(pattern)) for _ in range(reps + 1)][1:]
    srcs = [s for s, d in pattern if d == rank]
    out["pattern_ok"] = not srcs or bool((recv[:: max(1, n // 4096)] == srcs[0] + 1).all())
    out["receives"] = bool(srcs)
    del send, recv
    # what a receiver of a restore does first: a brand-new slot file in the RAM disk
    fresh = []
    for i in range(reps):
        path = os.path.join(cfg["base"], f"fresh-slot-r{rank}-{i}")

        def alloc() -> None:
            if not srcs:
                return
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, n)
                mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                mm.close()
            finally:
                os.close(fd)

        fresh.append(_barrier_time(alloc))
        if os.path.exists(path):
            os.unlink(path)
    out["fresh_slot_s"] = fresh
    # what a receiver's heal does now: plain writes of the received bytes into a new file
    src = torch.empty(n, dtype=torch.uint8)
    src.fill_(rank + 1)
    view = memoryview(src.numpy())
    writes = []
    for i in range(reps):
        path = os.path.join(cfg["base"], f"fresh-write-r{rank}-{i}")

        def write() -> None:
            if not srcs:
                return
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                for off in range(0, n, 4 << 20):
                    os.pwritev(fd, [view[off : off + (4 << 20)]], off)
            finally:
                os.close(fd)

        try:
            writes.append(_barrier_time(write))
        finally:
            if os.path.exists(path):
                os.unlink(path)
    out["fresh_write_s"] = writes
    return out


def phase_save(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import incluster

    t0 = time.perf_counter()
    state = build_state(cfg["bytes"], cfg["tensors"], seed=1000 + rank)
    build_s = time.perf_counter() - t0
    d = digest(tensors_of(state))
    ckpt = incluster.Checkpointer(job=JOB, writer="thread", replicas=1, slot_timeout_s=cfg["timeout_s"])
    dist.barrier()
    t0 = time.perf_counter()
    h = ckpt.save(STEP, state)
    blocked = time.perf_counter() - t0
    h.staged.result(cfg["timeout_s"])
    staged = time.perf_counter() - t0
    h.durable.result(cfg["timeout_s"])
    durable = time.perf_counter() - t0
    ckpt.close()
    return {"digest": d, "build_s": build_s, "blocked_s": blocked, "staged_s": staged, "durable_s": durable}


def phase_local(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = build_state(cfg["bytes"], cfg["tensors"], seed=None)
    expected = cfg["digests"][rank]
    runs = []
    for i in range(cfg["repeats"] + (1 if cfg["profile"] else 0)):
        runs.append(_restore_once(cfg, state, expected, profile=i == cfg["repeats"]))
    out: dict[str, Any] = {"restores": runs}
    # dcp: the same state, saved by the same ranks into /dev/shm, loaded back in place
    if cfg["dcp"]:
        dstate = {f"rank{rank}": state["model"]}
        path = cfg["dcp_dir"]
        out["dcp_save_s"] = _barrier_time(lambda: dcp.save(dstate, checkpoint_id=path))
        loads = []
        for _ in range(cfg["repeats"]):
            ptrs = [t.data_ptr() for t in tensors_of(state)]
            for t in tensors_of(state):
                t.zero_()
            s = _barrier_time(lambda: dcp.load(dstate, checkpoint_id=path))
            loads.append({
                "seconds": s,
                "bitwise": digest(tensors_of(state)) == expected,
                "in_place": [t.data_ptr() for t in tensors_of(state)] == ptrs,
            })
        out["dcp_loads"] = loads
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    return out


def phase_peer(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    state = build_state(cfg["bytes"], cfg["tensors"], seed=None)
    return {"restores": [_restore_once(cfg, state, cfg["digests"][rank], profile=cfg["profile"])]}


PHASES = {"gloo": phase_gloo, "save": phase_save, "local": phase_local, "peer": phase_peer}


def worker(cfg: dict[str, Any]) -> int:
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
    rank = dist.get_rank()
    res: dict[str, Any] = {"rank": rank, "node": os.environ.get("INCLUSTER_NODE"), "phase": cfg["phase"]}
    code = 0
    try:
        res.update(PHASES[cfg["phase"]](cfg, rank))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        code = 1
    with open(os.path.join(cfg["results"], f"{cfg['tag']}-r{rank}.json"), "w") as f:
        json.dump(res, f)
    if code:
        os._exit(code)  # peers stuck in a collective are killed by the driver
    dist.destroy_process_group()
    return 0


# =========================================================================================
# Driver
# =========================================================================================


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


def slowest(xs: Sequence[float]) -> float:
    return max(xs)


def med_of_max(per_rank: Sequence[Sequence[float]]) -> float:
    """Per repeat the slowest rank; then the median over repeats."""
    return statistics.median(max(col) for col in zip(*per_rank))


# -- planner ------------------------------------------------------------------------


def planner_case(world: int, rpn: int, runs: int, swaps: int = 4, check_placement: bool = False) -> dict[str, Any]:
    from incluster.recovery.plan import RankPlan, make_plan
    from incluster.topology import Topology, replica_targets

    n_nodes = world // rpn
    names = [f"node{i:05d}" for i in range(n_nodes)]
    steps = (990, 1000)  # keep=2: two steps held everywhere
    before = Topology.from_nodes([names[r // rpn] for r in range(world)])
    if check_placement:  # the rule used below is the library's (DESIGN §5), checked on a sample
        for r in range(0, world, max(1, world // 64)):
            t = replica_targets(before, r, 1)
            i, l = divmod(r, rpn)
            assert t == [((i + 1) % n_nodes) * rpn + l], (r, t)
    held: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
    for r in range(world):
        i = r // rpn
        for s in steps:
            held[names[i]].append((r, s))
            held[names[(i + 1) % n_nodes]].append((r, s))  # replica 1: next node, same local rank
    after = list(names)
    lost = n_nodes // 3
    after[lost] = "spare-0"
    pairs = [(1 + 7 * k, n_nodes - 2 - 11 * k) for k in range(swaps)]
    for a, b in pairs:
        after[a], after[b] = after[b], after[a]
    holdings = {n: v for n, v in held.items() if n != names[lost]}
    holdings["spare-0"] = []
    topo = Topology.from_nodes([after[r // rpn] for r in range(world)])
    times, plan = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = make_plan(topo, holdings)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    peers = [p for p in plan.ranks if p.source is not None]
    sends = [len(p.sends) for p in plan.ranks]
    # what the restore's exchange moves: rank 0 gathers (node, inventory or None) from every
    # rank (only local rank 0 of each node lists its folder) and scatters each rank's plan
    objs = [(after[r // rpn], holdings[after[r // rpn]] if r % rpn == 0 else None) for r in range(world)]
    sizes = [len(pickle.dumps(o)) for o in objs]
    plan_sizes = [len(pickle.dumps(p)) for p in plan.ranks]
    # the whole rank-0 planning round from the gathered list (library code, if present)
    round_s = None
    try:
        from incluster.recovery import restore as _restore

        ctx = _restore.Context(local_dir="/nonexistent", job=JOB, rank=0, world_size=world, node=after[0],
                               ring=None, allow_pickle=False, timeout_s=1.0)  # type: ignore[arg-type]
        rts = []
        for _ in range(max(1, runs // 2)):
            t0 = time.perf_counter()
            mine = _restore._plan_round(ctx, objs, set())
            rts.append(time.perf_counter() - t0)
        assert isinstance(mine, RankPlan) and mine.step == steps[-1]
        round_s = statistics.median(rts)
    except Exception as exc:  # noqa: BLE001 - informational only
        log(f"  plan round not timed: {type(exc).__name__}: {exc}")
    return {
        "world": world,
        "nodes": n_nodes,
        "ranks_per_node": rpn,
        "lost_node": names[lost],
        "swapped": [(names[a], names[b]) for a, b in pairs],
        "make_plan_s": times,
        "make_plan_median_s": statistics.median(times),
        "plan_round_median_s": round_s,
        "step": plan.step,
        "peer_ranks": len(peers),
        "local_ranks": world - len(peers),
        "max_sends_per_rank": max(sends),
        "inventory_pickled_bytes": sum(sizes),
        "inventory_max_object_bytes": max(sizes),
        "inventory_to_rank0_bytes": sum(sizes) + 8 * (world - 1),  # each rank: its length, its record
        "gather_object_wire_bytes": world * max(sizes),  # padded to the largest object
        "gather_object_size_allgather_bytes": world * world * 8,  # every rank receives W int64 sizes
        "plan_scatter_wire_bytes": world * max(plan_sizes),
        "plan_pickled_bytes": sum(plan_sizes),
    }


def placement_cost(world: int, rpn: int, sample: int = 32) -> dict[str, Any]:
    """What the Checkpointer constructor's rank 0 spends placing every rank's replica
    (``replica_targets`` for all W ranks), timed on a sample and scaled to W."""
    from incluster.topology import Topology, replica_targets

    topo = Topology.from_nodes([f"node{r // rpn:05d}" for r in range(world)])
    ranks = list(range(0, world, max(1, world // sample)))[:sample]
    t0 = time.perf_counter()
    for r in ranks:
        replica_targets(topo, r, 1)
    per = (time.perf_counter() - t0) / len(ranks)
    return {"world": world, "sampled_ranks": len(ranks), "per_rank_s": per, "all_ranks_estimate_s": per * world}


# -- report -------------------------------------------------------------------------


def fmt_s(x: float | None) -> str:
    return "—" if x is None else (f"{x:.3f}" if x < 100 else f"{x:.1f}")


def fmt_gbps(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def met(x: float | None, target: float) -> str:
    return "—" if x is None else ("yes" if x <= target else "NO")


def summarise(R: dict[str, Any]) -> dict[str, Any]:
    n = R["config"]["bytes"]
    S: dict[str, Any] = {}
    S["floor_1proc_s"] = median(R.get("floor_1proc_s", []))
    g = R.get("gloo")
    if g:
        S["floor_4ranks_s"] = med_of_max([r["floor_s"] for r in g])
        S["gloo_pair_s"] = med_of_max([r["pair_s"] for r in g])
        S["gloo_pattern_s"] = med_of_max([r["pattern_s"] for r in g])
        S["fresh_slot_s"] = med_of_max([r["fresh_slot_s"] for r in g])
        if all("fresh_write_s" in r for r in g):
            S["fresh_write_s"] = med_of_max([r["fresh_write_s"] for r in g])
        S["gloo_ok"] = all(r["pair_ok"] and r["pattern_ok"] for r in g)
    sv = R.get("save")
    if sv:
        S["save_durable_s"] = max(r["durable_s"] for r in sv)
        S["save_blocked_s"] = max(r["blocked_s"] for r in sv)
    loc = R.get("local")
    if loc:
        reps = R["config"]["repeats"]
        timed = [[r["restores"][i] for r in loc] for i in range(reps)]
        S["local_report_s"] = statistics.median(max(x["report"]["seconds"] for x in row) for row in timed)
        S["local_wall_s"] = statistics.median(max(x["wall_s"] for x in row) for row in timed)
        S["local_all"] = [[x["report"]["seconds"] for x in row] for row in timed]
        S["local_bitwise"] = all(x["bitwise"] and x["in_place"] for row in timed for x in row)
        S["local_sources"] = sorted({(x["report"]["source"]) for row in timed for x in row})
        if "dcp_loads" in loc[0]:
            S["dcp_load_s"] = statistics.median(max(r["dcp_loads"][i]["seconds"] for r in loc) for i in range(reps))
            S["dcp_save_s"] = max(r["dcp_save_s"] for r in loc)
            S["dcp_bitwise"] = all(x["bitwise"] and x["in_place"] for r in loc for x in r["dcp_loads"])
    peer = [p for p in R.get("peer", []) if not p["profiled"]]
    if peer:
        S["peer_report_s"] = statistics.median(max(x["report"]["seconds"] for x in p["ranks"]) for p in peer)
        S["peer_wall_s"] = statistics.median(max(x["wall_s"] for x in p["ranks"]) for p in peer)
        S["peer_heal_s"] = statistics.median(max(x["close_s"] for x in p["ranks"]) for p in peer)
        S["peer_bitwise"] = all(x["bitwise"] and x["in_place"] for p in peer for x in p["ranks"])
        S["peer_pattern"] = sorted({(x["report"]["source_rank"], x["rank"]) for p in peer for x in p["ranks"]
                                    if x["report"]["source"] == "peer"})
        S["peer_pattern_as_planned"] = S["peer_pattern"] == sorted(tuple(p) for p in R["config"]["pattern"])
    fl4, fl1 = S.get("floor_4ranks_s"), S.get("floor_1proc_s")
    if "local_report_s" in S:
        S["local_x_floor4"] = S["local_report_s"] / fl4 if fl4 else None
        S["local_x_floor1"] = S["local_report_s"] / fl1 if fl1 else None
        S["local_wall_x_floor4"] = S["local_wall_s"] / fl4 if fl4 else None
    if "peer_report_s" in S:
        gp, g2 = S.get("gloo_pattern_s"), S.get("gloo_pair_s")
        S["peer_x_gloo_pattern"] = S["peer_report_s"] / gp if gp else None
        S["peer_x_gloo_pair"] = S["peer_report_s"] / g2 if g2 else None
        fw = S.get("fresh_write_s")
        S["peer_x_gloo_and_heal"] = S["peer_report_s"] / (gp + fw) if gp and fw else None
        S["peer_wall_x_gloo_pattern"] = S["peer_wall_s"] / gp if gp else None
    if "dcp_load_s" in S and "local_report_s" in S:
        S["dcp_x_local"] = S["dcp_load_s"] / S["local_report_s"]
    S["bytes_per_rank"] = n
    return S


def print_report(R: dict[str, Any], S: dict[str, Any]) -> None:
    n = R["config"]["bytes"]
    ranks = R["config"]["ranks"]
    fl4, fl1 = S.get("floor_4ranks_s"), S.get("floor_1proc_s")
    gp, g2 = S.get("gloo_pattern_s"), S.get("gloo_pair_s")
    yes = lambda b: "—" if b is None else ("yes" if b else "NO")  # noqa: E731
    rows = [
        ["floor: copy_ into reused memory, 1 process", fmt_s(fl1), fmt_gbps(gbps(n, fl1)), "1.00x", "", "", ""],
        [f"floor: the same on {ranks} ranks at once", fmt_s(fl4), fmt_gbps(gbps(n, fl4)),
         fmt_ratio(fl4 / fl1 if fl4 and fl1 else None), "", "", ""],
        ["gloo batch_isend_irecv, 1 pair alone (0->1)", fmt_s(g2), fmt_gbps(gbps(n, g2)), "", "", "", yes(S.get("gloo_ok"))],
        [f"gloo, the restore's pattern {S.get('peer_pattern') or R['config']['pattern']}", fmt_s(gp),
         fmt_gbps(gbps(n, gp)), fmt_ratio(gp / g2 if gp and g2 else None) + " pair", "", "", yes(S.get("gloo_ok"))],
        ["new /dev/shm slot (fallocate+MAP_POPULATE), receivers at once", fmt_s(S.get("fresh_slot_s")),
         fmt_gbps(gbps(n, S.get("fresh_slot_s"))), "", "", "", ""],
        ["new /dev/shm file by plain pwrite (the heal now), receivers at once", fmt_s(S.get("fresh_write_s")),
         fmt_gbps(gbps(n, S.get("fresh_write_s"))), "", "", "", ""],
        ["incluster save(), until durable everywhere (reference)", fmt_s(S.get("save_durable_s")),
         fmt_gbps(gbps(n, S.get("save_durable_s"))), "", "", "", ""],
        ["incluster restore, own node's RAM (report)", fmt_s(S.get("local_report_s")),
         fmt_gbps(gbps(n, S.get("local_report_s"))), fmt_ratio(S.get("local_x_floor4")) + f" floor({ranks})",
         f"<= {LOCAL_TARGET}x", met(S.get("local_x_floor4"), LOCAL_TARGET), yes(S.get("local_bitwise"))],
        ["  the same against the 1-process floor", "", "", fmt_ratio(S.get("local_x_floor1")) + " floor(1)",
         f"<= {LOCAL_TARGET}x", met(S.get("local_x_floor1"), LOCAL_TARGET), ""],
        ["incluster restore, own node's RAM (load() wall)", fmt_s(S.get("local_wall_s")),
         fmt_gbps(gbps(n, S.get("local_wall_s"))), fmt_ratio(S.get("local_wall_x_floor4")) + f" floor({ranks})",
         f"<= {LOCAL_TARGET}x", met(S.get("local_wall_x_floor4"), LOCAL_TARGET), ""],
        ["incluster restore after spare + swap, peer (report)", fmt_s(S.get("peer_report_s")),
         fmt_gbps(gbps(n, S.get("peer_report_s"))), fmt_ratio(S.get("peer_x_gloo_pattern")) + " gloo pattern",
         f"<= {PEER_TARGET}x", met(S.get("peer_x_gloo_pattern"), PEER_TARGET), yes(S.get("peer_bitwise"))],
        ["  the same against one gloo pair alone", "", "", fmt_ratio(S.get("peer_x_gloo_pair")) + " gloo pair",
         f"<= {PEER_TARGET}x", met(S.get("peer_x_gloo_pair"), PEER_TARGET), ""],
        ["  the same against gloo pattern + the heal's pwrite, run apart (reference)", "", "",
         fmt_ratio(S.get("peer_x_gloo_and_heal")) + " sum", "", "", ""],
        ["incluster restore after spare + swap, peer (load() wall)", fmt_s(S.get("peer_wall_s")),
         fmt_gbps(gbps(n, S.get("peer_wall_s"))), fmt_ratio(S.get("peer_wall_x_gloo_pattern")) + " gloo pattern",
         f"<= {PEER_TARGET}x", met(S.get("peer_wall_x_gloo_pattern"), PEER_TARGET), ""],
        ["  then close(): drains the heal (re-replication)", fmt_s(S.get("peer_heal_s")), "", "", "", "", ""],
        ["dcp.save to /dev/shm (reference)", fmt_s(S.get("dcp_save_s")), fmt_gbps(gbps(n, S.get("dcp_save_s"))), "", "", "", ""],
        ["dcp.load from /dev/shm", fmt_s(S.get("dcp_load_s")), fmt_gbps(gbps(n, S.get("dcp_load_s"))),
         fmt_ratio(S.get("dcp_x_local")) + " local restore", "", "", yes(S.get("dcp_bitwise"))],
    ]
    c = R["config"]
    print(f"\nRestore of {human_size(n)} per rank, {ranks} ranks (gloo, one simulated node each, replicas=1, "
          f"writer=thread, {c['threads']} torch thread(s)/rank, {os.cpu_count()} CPUs); seconds = slowest rank, "
          f"median of {c['repeats']} (peer: of {c['peer_runs']} jobs); GB/s = bytes per rank / seconds")
    print(markdown_table(["measurement", "seconds", "GB/s", "ratio", "target", "met", "bitwise"], rows,
                         right=[False, True, True, True, True, True, True]))
    peer = [p for p in R.get("peer", []) if not p["profiled"]]
    if peer:
        print("\nPeer restore, per rank (first job):")
        rows = []
        for x in peer[0]["ranks"]:
            rep = x["report"]
            src = "own node" if rep["source"] == "local" else f"rank {rep['source_rank']} on {rep['source_node']}"
            rows.append([str(x["rank"]), rep["node"], src, f"{rep['bytes']}", fmt_s(rep["seconds"]), fmt_s(x["wall_s"]),
                         fmt_s(x["close_s"]), "yes" if x["bitwise"] and x["in_place"] else "NO"])
        print(markdown_table(["rank", "node", "from", "bytes", "report s", "wall s", "close s", "bitwise"], rows))
    if "local_all" in S:
        print("\nLocal restore, report seconds per repeat (ranks 0..3): "
              + "; ".join(", ".join(f"{v:.3f}" for v in row) for row in S["local_all"]))
    P = R.get("planner")
    if P:
        print(f"\nPlanner alone (make_plan; replicas=1, 2 steps held, 1 node lost -> spare, "
              f"{len(P['cases'][-1]['swapped'])} node pairs swapped; median of {R['config']['plan_runs']}):")
        rows = []
        for cse in P["cases"]:
            rows.append([str(cse["world"]), str(cse["nodes"]), fmt_s(cse["make_plan_median_s"]),
                         fmt_s(cse["plan_round_median_s"]), f"{cse['peer_ranks']}", f"{cse['inventory_pickled_bytes']:,}",
                         f"{cse['inventory_pickled_bytes'] / cse['world']:.1f}", f"{cse['inventory_to_rank0_bytes']:,}",
                         f"{cse['gather_object_wire_bytes'] + cse['gather_object_size_allgather_bytes']:,}",
                         f"{cse['plan_scatter_wire_bytes']:,}",
                         f"< {PLAN_TARGET_S:g} s", met(cse["make_plan_median_s"], PLAN_TARGET_S)])
        print(markdown_table(["ranks", "nodes", "make_plan s", "plan round s", "peer ranks", "inventories B",
                              "B/rank", "inventory to rank 0 B", "(gather_object would move B)", "plan scatter B",
                              "target", "met"], rows))
        pc = P.get("placement")
        if pc:
            print(f"Replica placement in the Checkpointer constructor (rank 0, replica_targets for all "
                  f"{pc['world']:,} ranks): ~{pc['all_ranks_estimate_s']:.1f} s (from {pc['sampled_ranks']} sampled "
                  f"ranks, {pc['per_rank_s'] * 1e3:.2f} ms each)")
    for kind in ("local", "peer"):
        prof = R.get("profiles", {}).get(kind)
        if prof:
            print(f"\nProfile of one {kind} restore, rank {prof['rank']} (cProfile of load(); incluster functions by cumulative time):")
            rows = [[f["func"], str(f["ncalls"]), f"{f['cumtime']:.3f}", f"{f['tottime']:.3f}"] for f in prof["funcs"][:14]]
            print(markdown_table(["function", "calls", "cum s", "own s"], rows))


# -- main ---------------------------------------------------------------------------


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
    ap.add_argument("--timeout", type=float, default=None, help="seconds per job before it is killed (default 1200)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke run")
    ap.add_argument("--json", metavar="OUT", help="also write every sample and the summary as JSON to OUT")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        return worker(json.loads(args._worker))
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
    cfg = {
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
        with scratch_dir("incluster-bench-recovery-") as base:
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
    print(f"\nload average {R['load_start']} -> {R['load_end']}; total {R['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(R, f, indent=1, default=str)
    return 1 if R.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
