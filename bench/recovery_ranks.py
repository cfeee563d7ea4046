"""One rank of a ``bench/recovery.py`` job: build the state, save it, restore it, time it.

Launched by the driver (``bench/recovery.py --_worker CFG``) through
``incluster.testing.launch``; each phase returns a JSON-able dict the driver reads back.
"""

from __future__ import annotations

import cProfile
import dataclasses
import datetime
import io
import json
import logging
import mmap
import os
import pstats
import shutil
import time
import traceback
from typing import Any, Sequence

import torch

JOB = "bench"
STEP = 1


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


def _read_floor(cfg: dict[str, Any], rank: int, send: torch.Tensor, recv: torch.Tensor) -> list[float]:
    """The same bytes read back from a file in the RAM disk with ``preadv`` into touched
    memory, 1 MiB at a time, on every rank at once, nothing checked: the least any restore
    from a RAM-disk file pays (the kernel's copy out of the page cache, per 4 KiB page)."""
    n, piece = send.numel(), 1 << 20
    path = os.path.join(cfg["base"], f"read-floor-r{rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        src = memoryview(send.numpy())
        for off in range(0, n, 4 << 20):
            os.pwritev(fd, [src[off : off + (4 << 20)]], off)
        dst = memoryview(recv.numpy())

        def read() -> None:
            for off in range(0, n, piece):
                os.preadv(fd, [dst[off : off + piece]], off)

        times = [_barrier_time(read) for _ in range(cfg["repeats"] + 1)][1:]
        if not bool((recv[:: max(1, n // 4096)] == rank + 1).all()):
            raise RuntimeError("the read floor read back the wrong bytes")
        return times
    finally:
        os.close(fd)
        os.unlink(path)


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
    out["read_floor_s"] = _read_floor(cfg, rank, send, recv)

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


def _paired_floors(rank: int, state: dict[str, Any], src: torch.Tensor) -> dict[str, float]:
    """Both floors, measured by the restoring ranks into the very tensors they restore, all
    4 at once: ``copy_`` from a touched tensor, and ``preadv`` of this rank's own shard
    file (1 MiB at a time, nothing checked: what any restore of that file pays at least)."""
    from incluster.staging.slots import step_file
    from incluster.tiers.local import rank_folder

    tensors = tensors_of(state)

    def copy() -> None:
        off = 0
        for t in tensors:
            t.view(-1).copy_(src[off : off + t.numel()])
            off += t.numel()

    path = os.path.join(rank_folder(os.environ["INCLUSTER_LOCAL_DIR"], JOB, rank), step_file(STEP))
    fd = os.open(path, os.O_RDONLY)
    try:
        data_start = os.fstat(fd).st_size - sum(t.numel() * 4 for t in tensors)

        def read() -> None:
            pos = data_start
            for t in tensors:
                view = memoryview(t.detach().view(-1).view(torch.uint8).numpy())
                for off in range(0, view.nbytes, 1 << 20):
                    piece = view[off : off + (1 << 20)]
                    os.preadv(fd, [piece], pos + off)
                pos += view.nbytes

        return {"copy_floor_s": _barrier_time(copy), "read_floor_s": _barrier_time(read)}
    finally:
        os.close(fd)


def phase_local(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = build_state(cfg["bytes"], cfg["tensors"], seed=None)
    expected = cfg["digests"][rank]
    src = torch.empty(sum(t.numel() for t in tensors_of(state)), dtype=torch.float32)
    src.fill_(1.0)
    runs = []
    for i in range(cfg["repeats"] + (1 if cfg["profile"] else 0)):
        floors = _paired_floors(rank, state, src)  # the same processes, just before the restore
        runs.append({**_restore_once(cfg, state, expected, profile=i == cfg["repeats"]), **floors})
    del src
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
