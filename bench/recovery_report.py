"""``bench/recovery.py``'s summary (medians of the slowest rank, ratios, targets) and its
printed tables."""

from __future__ import annotations

import os
import statistics
from typing import Any, Sequence

from _common import human_size, markdown_table, median  # noqa: E402 - bench/ is not a package
from recovery_planner import PLAN_TARGET_S

LOCAL_TARGET = 1.5
PEER_TARGET = 2.0
GB = 1e9


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / GB if seconds else None


def med_of_max(per_rank: Sequence[Sequence[float]]) -> float:
    """Per repeat the slowest rank; then the median over repeats."""
    return statistics.median(max(col) for col in zip(*per_rank))


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
        if all("read_floor_s" in r for r in g):
            S["read_floor_4ranks_s"] = med_of_max([r["read_floor_s"] for r in g])
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
        if all("copy_floor_s" in x for row in timed for x in row):
            S["local_x_paired_copy"] = statistics.median(
                max(x["report"]["seconds"] for x in row) / max(x["copy_floor_s"] for x in row) for row in timed)
            S["local_wall_x_paired_copy"] = statistics.median(
                max(x["wall_s"] for x in row) / max(x["copy_floor_s"] for x in row) for row in timed)
            S["local_x_paired_read"] = statistics.median(
                max(x["report"]["seconds"] for x in row) / max(x["read_floor_s"] for x in row) for row in timed)
            S["paired_copy_floor_s"] = statistics.median(max(x["copy_floor_s"] for x in row) for row in timed)
            S["paired_read_floor_s"] = statistics.median(max(x["read_floor_s"] for x in row) for row in timed)
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
        rf = S.get("read_floor_4ranks_s")
        S["local_x_read_floor"] = S["local_report_s"] / rf if rf else None
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


def mount_options(path: str) -> str:
    """The options of the mount ``path`` lives on (from /proc/mounts; "?" if unknown)."""
    best, opts = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) and len(parts[1]) > len(best):
                    best, opts = parts[1], f"{parts[2]} {parts[3]}"
    except OSError:
        pass
    return opts


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
        [f"read floor: preadv of the bytes from a RAM-disk file, {ranks} ranks at once", fmt_s(S.get("read_floor_4ranks_s")),
         fmt_gbps(gbps(n, S.get("read_floor_4ranks_s"))),
         fmt_ratio(S["read_floor_4ranks_s"] / fl4 if fl4 and S.get("read_floor_4ranks_s") else None) + f" floor({ranks})",
         "", "", ""],
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
         fmt_gbps(gbps(n, S.get("local_report_s"))), fmt_ratio(S.get("local_x_paired_copy")) + f" floor({ranks})",
         f"<= {LOCAL_TARGET}x", met(S.get("local_x_paired_copy"), LOCAL_TARGET), yes(S.get("local_bitwise"))],
        [f"  floor({ranks}), paired: the same ranks copy_ into the same tensors just before "
         f"({fmt_s(S.get('paired_copy_floor_s'))} s)", "", "", "", "", "", ""],
        [f"  read floor paired: preadv of their own shard files right before "
         f"({fmt_s(S.get('paired_read_floor_s'))} s)", "", "", fmt_ratio(S.get("local_x_paired_read")) + " read floor",
         "", "", ""],
        ["  against the floors of the gloo job above (other processes, earlier: noisier)", "", "",
         f"{fmt_ratio(S.get('local_x_floor4'))} floor({ranks}), {fmt_ratio(S.get('local_x_read_floor'))} read",
         "", "", ""],
        ["  against the 1-process floor", "", "", fmt_ratio(S.get("local_x_floor1")) + " floor(1)", "", "", ""],
        ["incluster restore, own node's RAM (load() wall)", fmt_s(S.get("local_wall_s")),
         fmt_gbps(gbps(n, S.get("local_wall_s"))), fmt_ratio(S.get("local_wall_x_paired_copy")) + f" floor({ranks})",
         f"<= {LOCAL_TARGET}x", met(S.get("local_wall_x_paired_copy"), LOCAL_TARGET), ""],
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
          f"median of {c['repeats']} (peer: of {c['peer_runs']} jobs); GB/s = bytes per rank / seconds; "
          f"RAM disk {c.get('ram_disk', '/dev/shm')} ({c.get('ram_disk_mount') or mount_options(c.get('ram_disk', '/dev/shm'))})")
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
