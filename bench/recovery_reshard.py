"""Elastic restore: incluster's resharding restore against ``dcp.load`` resharding the same
state from the same RAM disk, in the same run.

4 ranks (gloo on 127.0.0.1, 4 simulated nodes n0-n3, one rank each, replicas=1,
``--writer`` thread or process) build an FSDP2 model (a stack of ``Linear(H, H)`` layers,
fp32, ``fully_shard`` per layer on a 1-D mesh; ``--optim``: with AdamW's two moments,
also DTensors) holding ``--gib`` GiB of DTensors per rank, filled with a pattern that is a
function of each element's global index (so any rank can check its own piece of any
layout). They save it once with incluster (waited until durable) and once with
``torch.distributed.checkpoint.save`` into a folder in /dev/shm. Then node n3's RAM folder
is deleted and 3 ranks start on n0-n2, build the same model on a 3-rank mesh (H is not a
multiple of 3: every shard boundary moves) and, ``--repeats`` times, alternately:

  incluster   ``Checkpointer(...).load(state)``: resharded from the shards in n0-n2's RAM
              (old rank 3's from its replica on n0), peer to peer over gloo
              (``last_restore.source == "reshard"``)
  dcp.load    ``dcp.load`` of the DCP folder into the same live FSDP2 state (DCP
              reshards; with ``--optim`` via ``get_state_dict``/``set_state_dict``)

each from zeroed live tensors, after a barrier; per repeat the slowest rank counts
(``wall``: around the call; ``report``: ``last_restore.seconds``), then the median. After
every restore each rank checks every element of every local DTensor against the pattern
at its global index (bitwise, as int32): together the ranks check the full state, which
was checked the same way before it was saved.

Memory (default 1 GiB per rank, 4 GiB of state): saving holds up to 16 GiB (live state,
own shards, replicas, the free slot each rank allocates after a save: removed before the
DCP save, which adds 4 GiB); restoring holds 6 GiB of shards and 4 GiB of DCP files in
/dev/shm, 4 GiB of live state and the free slot (1.33 GiB) each new rank allocates for
its next save. Both peaks are sampled (RAM in use on the whole machine): 17.8 GiB saving,
20.2 GiB restoring, measured. This fits in 24 GiB of RAM; larger ``--gib`` is refused
unless about 18 x ``--gib`` + 1 GiB of RAM is available. Everything lives in one
folder under /dev/shm that is removed at the end, also on failure or SIGTERM.

    python bench/recovery_reshard.py                  # 1 GiB per rank; about 2 minutes on 2 cores
    python bench/recovery_reshard.py --quick          # 1/16 GiB per rank, one repeat
    python bench/recovery_reshard.py --optim --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import human_size, loadavg, log, machine_info, markdown_table, scratch_dir, source_commit  # noqa: E402
from recovery_reshard_ranks import STEP, worker  # noqa: E402

OLD, NEW = ["n0", "n1", "n2", "n3"], ["n0", "n1", "n2"]


class PeakMemory:
    """The most RAM in use (total - available: processes and /dev/shm alike), sampled."""

    def __init__(self) -> None:
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        while not self._stop.wait(0.2):
            vm = psutil.virtual_memory()
            self.peak = max(self.peak, vm.total - vm.available)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def run_job(base: str, nodes: list[str], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from incluster.testing.launch import launch

    log(f"{cfg['phase']} on {','.join(nodes)} (load {loadavg()})")
    t0 = time.monotonic()
    job = launch([os.path.abspath(__file__), "--_worker", json.dumps(cfg)], nodes=nodes, ranks_per_node=1,
                 base_dir=base, env={"OMP_NUM_THREADS": str(cfg["threads"]), "PYTHONWARNINGS": "ignore"})
    try:
        codes = job.wait(cfg["timeout_s"])
    finally:
        job.kill_all()
    res = []
    for r in range(len(nodes)):
        p = os.path.join(cfg["results"], f"{cfg['phase']}-r{r}.json")
        res.append(json.load(open(p)) if os.path.exists(p) else {"error": job.output(r)[-3000:]})
    errs = [o["error"] for o in res if o.get("error")]
    if any(codes) or errs:
        raise RuntimeError(f"{cfg['phase']} failed: exit codes {codes}\n{errs[0] if errs else ''}")
    log(f"{cfg['phase']} done in {time.monotonic() - t0:.1f} s")
    return res


def summarise(save: list[dict[str, Any]], load: list[dict[str, Any]]) -> dict[str, Any]:
    def slowest(kind: str, key: str) -> list[float]:
        return [max(r[kind][k][key] for r in load) for k in range(len(load[0][kind]))]

    S: dict[str, Any] = {"save_durable_s": max(r["save_s"] for r in save), "dcp_save_s": max(r["dcp_save_s"] for r in save)}
    for key, kind, field in (("incluster_wall_s", "incluster", "wall_s"), ("incluster_report_s", "incluster", "report_s"),
                             ("dcp_load_s", "dcp", "wall_s")):
        S[key + "_per_repeat"] = slowest(kind, field)
        S[key] = statistics.median(S[key + "_per_repeat"])
    S["ratio_wall"] = S["incluster_wall_s"] / S["dcp_load_s"]
    S["ratio_report"] = S["incluster_report_s"] / S["dcp_load_s"]
    S["bitwise"] = all(not x["bad"] for r in load for k in ("incluster", "dcp") for x in r[k]) and \
        all(not r["bad_before_save"] for r in save)
    S["resharded"] = all(x["source"] == "reshard" and x["step"] == STEP for r in load for x in r["incluster"])
    S["bytes_landed_per_rank"] = [r["incluster"][0]["bytes"] for r in load]
    return S


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=None, help="DTensor state per rank in GiB (default 1.0; --quick 1/16)")
    ap.add_argument("--hidden", type=int, default=None, help="Linear width H (default 8192; --quick 2048)")
    ap.add_argument("--optim", action="store_true", help="AdamW moments too (--gib counts them)")
    ap.add_argument("--writer", choices=("thread", "process"), default="thread")
    ap.add_argument("--repeats", type=int, default=None, help="timed restores of each kind (default 3; --quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cpus // 4, >= 1)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per job (default 1800; --quick 300)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke run")
    ap.add_argument("--json", metavar="OUT", help="also write every sample and the summary as JSON to OUT")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        return worker(json.loads(args._worker))
    gib = args.gib if args.gib is not None else (1 / 16 if args.quick else 1.0)
    hidden = args.hidden or (2048 if args.quick else 8192)
    per_layer = 4 * hidden * (hidden + 1) * (3 if args.optim else 1)
    layers = max(1, round(gib * len(OLD) * (1 << 30) / per_layer))
    cfg: dict[str, Any] = {"hidden": hidden, "layers": layers, "optim": args.optim, "writer": args.writer,
                           "repeats": args.repeats or (1 if args.quick else 3),
                           "threads": args.threads or max(1, (os.cpu_count() or 1) // len(OLD)),
                           "timeout_s": args.timeout or (300.0 if args.quick else 1800.0)}
    total = layers * per_layer
    try:
        import psutil

        need, avail = int(4.5 * total) + (1 << 30), psutil.virtual_memory().available
        if avail < need:
            log(f"needs about {need / 2**30:.1f} GiB of free RAM, {avail / 2**30:.1f} GiB available: use a smaller --gib")
            return 2
    except ImportError:
        pass
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks clean up
    R: dict[str, Any] = {"config": {**cfg, "state_bytes": total, "old_nodes": OLD, "new_nodes": NEW},
                         "machine": machine_info(), "load_start": loadavg(), "commit": source_commit()}
    t_all = time.monotonic()
    log(f"{layers} x Linear({hidden}, {hidden}){' + AdamW' if args.optim else ''}: {human_size(total)} of DTensors")
    try:
        with scratch_dir("incluster-bench-reshard-") as base:
            cfg |= {"base": base, "dcp_dir": os.path.join(base, "dcp"), "results": os.path.join(base, "results")}
            os.makedirs(cfg["results"])
            mem = PeakMemory()
            R["save"] = run_job(base, OLD, {**cfg, "phase": "save"})
            R["peak_ram_used_save_bytes"] = mem.stop()
            mem = PeakMemory()
            shutil.rmtree(os.path.join(base, OLD[-1]))  # node n3 is gone, its RAM with it
            R["ram_disk_bytes_at_load"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(base) for f in fs)
            R["load"] = run_job(base, NEW, {**cfg, "phase": "load"})
            R["peak_ram_used_load_bytes"] = mem.stop()
            R["after_load_files"] = {os.path.relpath(os.path.join(d, f), base): os.path.getsize(os.path.join(d, f))
                                     for d, _, fs in os.walk(base) for f in fs if os.sep + "n" in d}
    except BaseException as exc:
        R["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {R['error'][:6000]}")
        if not isinstance(exc, Exception):
            raise
    R["total_s"], R["load_end"] = time.monotonic() - t_all, loadavg()
    if "error" not in R:
        S = R["summary"] = summarise(R["save"], R["load"])
        print(f"{len(OLD)} -> {len(NEW)} ranks, FSDP2 {layers} x Linear({hidden}){' + AdamW' if args.optim else ''}, "
              f"{human_size(total)} of state, writer={args.writer}; slowest rank, median of {cfg['repeats']}\n")
        f = lambda x: f"{x:.3f}"  # noqa: E731
        print(markdown_table(["restore into 3 ranks", "seconds", "vs dcp.load", "per repeat"], [
            ["incluster load (wall)", f(S["incluster_wall_s"]), f"{S['ratio_wall']:.2f}x",
             " ".join(map(f, S["incluster_wall_s_per_repeat"]))],
            ["incluster load (last_restore.seconds)", f(S["incluster_report_s"]), f"{S['ratio_report']:.2f}x",
             " ".join(map(f, S["incluster_report_s_per_repeat"]))],
            ["dcp.load", f(S["dcp_load_s"]), "1.00x", " ".join(map(f, S["dcp_load_s_per_repeat"]))],
        ], right=[False, True, True, True]))
        print(f"\nsave: incluster durable {S['save_durable_s']:.2f} s, dcp.save {S['dcp_save_s']:.2f} s; bytes landed "
              f"per rank {[human_size(b) for b in S['bytes_landed_per_rank']]}; source reshard: {S['resharded']}; "
              f"bitwise: {S['bitwise']}; peak RAM in use (all of the machine) {R['peak_ram_used_save_bytes'] / 2**30:.1f} GiB "
              f"saving, {R['peak_ram_used_load_bytes'] / 2**30:.1f} GiB restoring")
    print(f"load average {R['load_start']} -> {R['load_end']}; total {R['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(R, fh, indent=1, default=str)
    return 1 if R.get("error") or not (R["summary"]["bitwise"] and R["summary"]["resharded"]) else 0


if __name__ == "__main__":
    sys.exit(main())
