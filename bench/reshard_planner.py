"""The resharding planner at scale, no processes: 16,384 old ranks -> 12,288 new ranks.

Scenario: a job of 2,048 nodes x 8 ranks saved a step (two steps held, keep=2) with
replicas=1 (each rank's shard also on the next node, same local rank: the library's
placement rule). The new job has lost every 4th node (512 nodes): every old shard still
has a copy (a lost node's own shards sit on the next node, its replicas on the previous
one), and 1,536 nodes x 8 = 12,288 ranks restart.

Measured (median of ``--runs``):

  make_plan              ``incluster.recovery.plan.make_plan(Topology, holdings)`` on rank 0,
                         holdings as ``(owner, step, size, world)`` per node (target < 1 s);
                         also at 1/8 and 1/4 of the size, to show how it scales
  plan round             rank 0's whole planning round from the gathered inventories
                         (``plan_round.plan_round``: holdings built from the JSON records,
                         the plan, the per-rank records and the ``server_of + node_of`` list)
  per-rank pieces        what each rank computes locally once it has ``Maps``:
                         ``receiver_pieces(rank, old, my_boxes, maps)`` and, for every old
                         shard it serves, ``list(server_pieces(owner, old, new, maps))``, plus
                         ``layout_digest``; over a sample of ``--sample`` ranks spread over
                         the job and the rank serving the most old shards (median and max)

for a Llama-7B-like FSDP2 tree (32 blocks of wq/wk/wv/wo (4096, 4096), w1/w3 (11008, 4096),
w2 (4096, 11008), two (4096,) norms, plus embedding/output (32000, 4096) and a norm:
291 float32 tensors; ``+AdamW``: with both moments, 873), each ``Shard(0)`` on a 1-D mesh
(FSDP2), and the same tree under HSDP (``(Replicate, Shard(0))`` on a 128 x 128 mesh ->
96 x 128; ``--hsdp-shard``), where each receiver picks one of the replicas. The serving
side walks every new replica coordinate and, for each, every old replica
(``choose_owner``): O(replicas^2) per tensor and served shard, so a narrower shard
group costs far more (measured per serving rank: 0.2-0.5 s at 128 x 128, 14 s at
1024 x 16 -> 768 x 16, 46 s at 2048 x 8 -> 1536 x 8; ``--hsdp-shard 16 --sample 1``).

Bytes (exact JSON sizes of what the restore sends): rank 0 receives every rank's 8-byte
length and its ``[node, inventory or null]`` record (only local rank 0 of each node lists
its folder; O(W)), sends each rank its 8-byte length and ``RankPlan`` record, and
broadcasts ``server_of + node_of`` ((old + new) int64s). Under gloo the broadcast is a
binomial tree: rank 0 sends the payload ceil(log2 W) times, every other rank receives it
once (NCCL pipelines it: about once).

    python bench/reshard_planner.py                  # ~15 s on 2 cores
    python bench/reshard_planner.py --quick --json /tmp/p.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import human_size, loadavg, log, machine_info, markdown_table, source_commit  # noqa: E402

TARGET_S = 1.0
STEPS = (990, 1000)
SHARD_BYTES = 13_476_839_424 * 3 // 16384  # a 6.7 B model + AdamW moments, fp32, over 16,384 ranks


def scenario(old_world: int, rpn: int, lose_every: int = 4) -> tuple[Any, dict[str, list[tuple[int, ...]]], list[Any]]:
    """(new Topology, holdings of the surviving nodes, gathered inventories as rank 0 gets them)."""
    from incluster.topology import Topology, replica_targets

    n = old_world // rpn
    names = [f"node{i:05d}" for i in range(n)]
    before = Topology.from_nodes([names[r // rpn] for r in range(old_world)])
    for r in range(0, old_world, max(1, old_world // 64)):  # the placement rule used below is the library's
        assert replica_targets(before, r, 1) == [((r // rpn + 1) % n) * rpn + r % rpn], r
    held: dict[str, list[tuple[int, ...]]] = {m: [] for m in names}
    for r in range(old_world):
        i = r // rpn
        for s in STEPS:
            held[names[i]].append((r, s, SHARD_BYTES, old_world))
            held[names[(i + 1) % n]].append((r, s, SHARD_BYTES, old_world))
    alive = [m for i, m in enumerate(names) if i % lose_every != lose_every - 1]
    topo = Topology.from_nodes([m for m in alive for _ in range(rpn)])
    holdings = {m: held[m] for m in alive}
    gathered = [[m, [list(x) for x in holdings[m]] if k == 0 else None] for m in alive for k in range(rpn)]
    return topo, holdings, gathered


def timed(fn: Any, runs: int) -> tuple[float, list[float], Any]:
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def plan_case(old_world: int, rpn: int, runs: int) -> dict[str, Any]:
    from incluster.recovery.plan import make_plan

    topo, holdings, gathered = scenario(old_world, rpn)
    med, times, plan = timed(lambda: make_plan(topo, holdings), runs)
    assert plan.step == STEPS[-1] and plan.world == old_world and len(plan.server_of) == old_world, plan.step
    for o in range(0, old_world, 97):  # every server sits on a node holding a copy
        node = topo.node_of[plan.server_of[o]]
        assert any(x[0] == o and x[1] == STEPS[-1] for x in holdings[node]), o
    load = [0] * topo.world_size
    for s in plan.server_of:
        load[s] += 1
    out = {"old_world": old_world, "new_world": topo.world_size, "nodes_before": old_world // rpn,
           "nodes_after": len(topo.nodes), "make_plan_s": times, "make_plan_median_s": med,
           "servers": sum(1 for c in load if c), "max_shards_served": max(load),
           "same_rank_served": sum(1 for o, s in enumerate(plan.server_of) if o == s)}
    return {**out, "_plan": plan, "_topo": topo, "_gathered": gathered}


def plan_round_s(case: dict[str, Any], runs: int) -> float | None:
    """Rank 0's whole planning round (library code) from the JSON-round-tripped records."""
    try:
        from incluster.recovery import restore as R
        from incluster.recovery.plan_round import plan_round

        topo = case["_topo"]
        ctx = R.Context(local_dir="/nonexistent", job="bench", rank=0, world_size=topo.world_size,
                        node=topo.node_of[0], ring=None, allow_pickle=False, timeout_s=1.0)  # type: ignore[arg-type]

        def once() -> Any:
            shared: dict[str, Any] = {}
            mine = plan_round(ctx, case["_gathered"], set(), [], shared)
            assert len(shared["maps"]) == case["old_world"] + topo.world_size, mine
            return mine

        return timed(once, runs)[0]
    except Exception as exc:  # noqa: BLE001 - informational only
        log(f"  plan round not timed: {type(exc).__name__}: {exc}")
        return None


def wire_bytes(case: dict[str, Any]) -> dict[str, Any]:
    topo, plan, old = case["_topo"], case["_plan"], case["old_world"]
    W = topo.world_size
    rec = [len(json.dumps(g, separators=(",", ":"))) for g in case["_gathered"]]
    pl = [len(json.dumps(dataclasses.asdict(p), separators=(",", ":"))) for p in plan.ranks]
    maps = (old + W) * 8
    fan = math.ceil(math.log2(W))
    return {
        "rank0_gather_in_bytes": sum(8 + b for b in rec[1:]),
        "inventory_records": sum(1 for g in case["_gathered"] if g[1] is not None),
        "rank0_scatter_out_bytes": sum(8 + b for b in pl[1:]),
        "maps_payload_bytes": maps,
        "rank0_broadcast_out_bytes_gloo": fan * maps,
        "rank0_total_out_bytes_gloo": sum(8 + b for b in pl[1:]) + fan * maps,
        "other_rank_in_bytes": 8 + max(pl) + maps,
        "other_rank_out_bytes": 8 + max(rec[1:]),
    }


def llama_tree(adam: bool) -> dict[str, tuple[int, ...]]:
    h, f, v = 4096, 11008, 32000
    t: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, h)}
    for i in range(32):
        p = f"layers.{i}."
        t |= {p + f"attention.{w}.weight": (h, h) for w in ("wq", "wk", "wv", "wo")}
        t |= {p + "feed_forward.w1.weight": (f, h), p + "feed_forward.w2.weight": (h, f),
              p + "feed_forward.w3.weight": (f, h), p + "attention_norm.weight": (h,), p + "ffn_norm.weight": (h,)}
    t |= {"norm.weight": (h,), "output.weight": (v, h)}
    t = {f"model/{k}": s for k, s in t.items()}
    if adam:
        t |= {f"optim/state/{k[6:]}/{m}": s for k, s in list(t.items()) for m in ("exp_avg", "exp_avg_sq")}
    return t


def pieces_case(case: dict[str, Any], tree: dict[str, tuple[int, ...]], meshes: tuple[tuple[int, ...], tuple[int, ...]],
                placements: tuple[tuple[Any, ...], ...], sample: int) -> dict[str, Any]:
    from incluster.recovery.boxes import Layout, coord_of, numel
    from incluster.recovery.reshard_pieces import Maps, layout_digest, receiver_pieces, server_pieces

    topo, plan = case["_topo"], case["_plan"]
    old_mesh, new_mesh = meshes
    assert math.prod(old_mesh) == case["old_world"] and math.prod(new_mesh) == topo.world_size
    old = {n: Layout("F32", s, old_mesh, placements) for n, s in tree.items()}
    new = {n: Layout("F32", s, new_mesh, placements) for n, s in tree.items()}
    maps = Maps(list(plan.server_of), [topo.node_index(n) for n in topo.node_of])
    serves: dict[int, list[int]] = {}
    for o, s in enumerate(plan.server_of):
        serves.setdefault(s, []).append(o)
    W = topo.world_size
    ranks = sorted(set(range(0, W, max(1, W // sample))) | {W - 1, max(serves, key=lambda r: (len(serves[r]), -r))})
    rows = []
    for r in ranks:
        t0 = time.perf_counter()
        mine = {n: lay.box(coord_of(r, new_mesh)) for n, lay in new.items()}
        got = receiver_pieces(r, old, mine, maps)
        t1 = time.perf_counter()
        out = [x for o in serves.get(r, []) for x in server_pieces(o, old, new, maps)]
        t2 = time.perf_counter()
        layout_digest(old, new, "same-rank", case["old_world"])
        t3 = time.perf_counter()
        rows.append({"rank": r, "recv_s": t1 - t0, "serve_s": t2 - t1, "digest_s": t3 - t2, "total_s": t3 - t0,
                     "served": len(serves.get(r, [])), "pieces_in": len(got), "pieces_out": len(out),
                     "bytes_in": 4 * sum(numel(p.box) for p in got if plan.server_of[p.owner] != r),
                     "bytes_out": 4 * sum(numel(p.box) for q, p in out if q != r)})
    med = {k: statistics.median(x[k] for x in rows) for k in ("recv_s", "serve_s", "digest_s", "total_s")}
    mx = {k: max(x[k] for x in rows) for k in ("recv_s", "serve_s", "digest_s", "total_s", "pieces_in", "bytes_in",
                                                  "bytes_out")}
    return {"tensors": len(tree), "old_mesh": old_mesh, "new_mesh": new_mesh, "placements": placements,
            "sampled_ranks": len(rows), "median": med, "max": mx, "ranks": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=int, default=16384, help="old world size (default 16384; new = 3/4 of it)")
    ap.add_argument("--rpn", type=int, default=8, help="ranks per node (default 8)")
    ap.add_argument("--runs", type=int, default=None, help="make_plan runs per size (default 5; --quick: 3)")
    ap.add_argument("--sample", type=int, default=None, help="ranks sampled for the piece lists (default 32; --quick 8)")
    ap.add_argument("--hsdp-shard", type=int, default=128, help="HSDP shard group size (default 128; the "
                    "replica dimension is the rest: each served shard costs O(replicas^2) per tensor)")
    ap.add_argument("--quick", action="store_true", help="fewer runs and sampled ranks")
    ap.add_argument("--json", metavar="OUT", help="also write every sample and the summary as JSON to OUT")
    args = ap.parse_args(argv)
    runs = args.runs or (3 if args.quick else 5)
    sample = args.sample or (8 if args.quick else 32)
    S = args.hsdp_shard
    if args.old % (args.rpn * 4) or args.old % (4 * S):
        ap.error("--old must be a multiple of 4 x --rpn and of 4 x --hsdp-shard")
    R: dict[str, Any] = {"machine": machine_info(), "load_start": loadavg(), "target_make_plan_s": TARGET_S,
                         "runs": runs, "shard_bytes": SHARD_BYTES, "commit": source_commit()}
    t_all = time.monotonic()
    cases = []
    for w in sorted({args.old // 8, args.old // 4, args.old}):
        log(f"make_plan: {w} -> {w * 3 // 4} ranks")
        cases.append(plan_case(w, args.rpn, runs))
    big = cases[-1]
    big["plan_round_median_s"] = plan_round_s(big, max(1, runs // 2))
    big["bytes"] = wire_bytes(big)
    W = big["new_world"]
    trees = [("FSDP2 1-D", False, ((args.old,), (W,)), (("S", 0),)),
             ("FSDP2 1-D +AdamW", True, ((args.old,), (W,)), (("S", 0),)),
             ("HSDP 2-D", False, ((args.old // S, S), (W // S, S)), (("R",), ("S", 0)))]
    pieces = []
    for label, adam, meshes, pl in trees:
        log(f"pieces: {label}")
        pieces.append({"label": label, **pieces_case(big, llama_tree(adam), meshes, pl, sample)})
    R["planner"] = [{k: v for k, v in c.items() if not k.startswith("_")} for c in cases]
    R["pieces"] = pieces
    R["total_s"] = time.monotonic() - t_all
    R["load_end"] = loadavg()

    rows = [[f"{c['old_world']:,} -> {c['new_world']:,}", f"{c['nodes_before']:,} -> {c['nodes_after']:,}",
             f"{c['make_plan_median_s'] * 1e3:.1f}", f"{c['max_shards_served']}",
             "yes" if c["make_plan_median_s"] < TARGET_S else "NO"] for c in cases]
    print(f"make_plan (median of {runs}); target: make_plan < {TARGET_S:.0f} s at {args.old:,} -> {W:,}\n")
    print(markdown_table(["ranks", "nodes", "make_plan ms", "max shards/rank", "< 1 s"], rows))
    if big.get("plan_round_median_s") is not None:
        print(f"\nrank 0's whole planning round at {args.old:,} -> {W:,}: {big['plan_round_median_s'] * 1e3:.1f} ms")
    b = big["bytes"]
    print(f"\nbytes of the plan at {args.old:,} -> {W:,} (JSON as sent):\n")
    print(markdown_table(["what", "bytes"], [
        [f"rank 0 receives: lengths + {b['inventory_records']} inventories + {W - b['inventory_records'] - 1} nulls",
         human_size(b["rank0_gather_in_bytes"])],
        ["rank 0 sends: lengths + RankPlan records (scatter)", human_size(b["rank0_scatter_out_bytes"])],
        [f"server_of + node_of payload ({args.old:,} + {W:,} int64)", human_size(b["maps_payload_bytes"])],
        ["rank 0 sends for it under gloo (binomial tree)", human_size(b["rank0_broadcast_out_bytes_gloo"])],
        ["any other rank receives in all", human_size(b["other_rank_in_bytes"])],
    ], right=[False, True]))
    print(f"\nper-rank piece lists ({sample} sampled ranks + the busiest server; ms, median / max):\n")
    prow = []
    for p in pieces:
        m, x = p["median"], p["max"]
        prow.append([p["label"], str(p["tensors"]), "x".join(map(str, p["old_mesh"])) + " -> " + "x".join(map(str, p["new_mesh"])),
                     f"{m['recv_s'] * 1e3:.1f} / {x['recv_s'] * 1e3:.1f}", f"{m['serve_s'] * 1e3:.1f} / {x['serve_s'] * 1e3:.1f}",
                     f"{m['digest_s'] * 1e3:.1f}", f"{m['total_s'] * 1e3:.1f} / {x['total_s'] * 1e3:.1f}",
                     str(x["pieces_in"]), human_size(x["bytes_in"])])
    print(markdown_table(["tree", "tensors", "mesh", "receiver_pieces", "server_pieces", "digest", "total",
                          "max pieces in", "max bytes in"], prow, right=[False] + [True] * 8))
    print(f"\nload average {R['load_start']} -> {R['load_end']}; total {R['total_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(R, f, indent=1, default=str)
    return 0 if cases[-1]["make_plan_median_s"] < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
