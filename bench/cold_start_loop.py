"""The README's training loop from a cold start: what do the first saves cost the loop?

A fresh process builds the README's small model, creates the checkpointer and trains 200
steps, saving every 10 (the first saves fall inside the writer process's start, a fresh
interpreter importing torch: 1-7 s). Per system it prints the slowest step of the loop
(forward, backward, ``optimizer.step()`` and the ``save()`` call, when there is one), the
slowest ``save()`` call, and the loop's total, medians over ``--runs`` fresh processes:

  incluster      Checkpointer(local_dir=/dev/shm/...), its default writer process
  dcp.async      torch.distributed.checkpoint.async_save to /dev/shm, default stager,
                 each save's future waited for before the next save (DCP allows one in flight)

    python bench/cold_start_loop.py            # 3 runs each, about a minute
    python bench/cold_start_loop.py --runs 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

STEPS, EVERY = 200, 10

CHILD = r"""
import json, os, shutil, sys, tempfile, time, warnings
import torch
warnings.filterwarnings("ignore")
system = sys.argv[1]
root = tempfile.mkdtemp(prefix="bench-cold-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
try:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t_start = time.perf_counter()
    if system == "incluster":
        import incluster
        ckpt = incluster.Checkpointer(local_dir=root, job="bench-cold")
        state = {"model": model, "optim": optim, "extra": {"samples": 0}}
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        pending = None
    steps, saves = [], []
    for step in range(STEPS):
        t0 = time.perf_counter()
        x = torch.randn(32, 64)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step % EVERY == 0:
            s0 = time.perf_counter()
            if system == "incluster":
                ckpt.save(step, state)
            else:
                if pending is not None:
                    pending.result()
                msd, osd = get_state_dict(model, optim)
                pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"step-{step}"))
            saves.append(time.perf_counter() - s0)
        steps.append((time.perf_counter() - t0, step))
    if system == "incluster":
        ckpt.close()
    elif pending is not None:
        pending.result()
    total = time.perf_counter() - t_start
    worst = max(steps)
    print(json.dumps({"worst_step_s": worst[0], "worst_step": worst[1], "worst_save_s": max(saves),
                      "median_step_s": sorted(s for s, _ in steps)[len(steps) // 2], "total_s": total}))
finally:
    shutil.rmtree(root, ignore_errors=True)
""".replace("STEPS", str(STEPS)).replace("EVERY", str(EVERY))


def run(system: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, system], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{system} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per system (default 3)")
    ap.add_argument("--json", metavar="OUT", help="also write every run as JSON to OUT")
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for system in ("incluster", "dcp.async"):
        results[system] = [run(system) for _ in range(args.runs)]
    med = {s: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for s, runs in results.items()}
    print(f"# cold-start loop: {STEPS} steps, a save every {EVERY}, {args.runs} fresh processes each, "
          f"{os.cpu_count()} CPUs; medians, ms")
    print()
    print("| system | slowest step | slowest save() call | median step | loop total |")
    print("|:--|--:|--:|--:|--:|")
    for s, m in med.items():
        print(f"| {s} | {m['worst_step_s'] * 1e3:.1f} | {m['worst_save_s'] * 1e3:.1f} | "
              f"{m['median_step_s'] * 1e3:.2f} | {m['total_s'] * 1e3:.0f} |")
    ratio = med["dcp.async"]["worst_step_s"] / med["incluster"]["worst_step_s"]
    print()
    print(f"slowest step: dcp.async / incluster = {ratio:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "medians": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
