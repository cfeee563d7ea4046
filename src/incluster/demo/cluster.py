"""``incluster demo``: a simulated cluster loses a node, a hot spare takes its place, two
surviving nodes swap positions, and training resumes from the cluster's own RAM.
``--no-spare``: no node takes its place; the job restarts on the surviving nodes (fewer
ranks, the state sharded with FSDP2) and restores the same step resharded from their RAM.

Every rank is a real process running ``train_tiny_gpt.py`` (the script in examples/) with
the environment torchrun would give it plus its node's name and RAM folder; gloo on
127.0.0.1. The failure is a real SIGKILL of the node's processes and the loss of its RAM
folder. Afterwards the same failure is restored once more from the persistent tier only,
at the bandwidth given, to show what it would have cost without in-cluster copies.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from incluster.demo import at_least
from incluster.testing.launch import Job, launch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tiny_gpt.py")


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="simulated cluster: node failure, hot spare (or fewer ranks, resharded), recovery from peers")
    p.add_argument("--nodes", type=at_least(2), default=4, help="nodes in the job (default 4), plus one hot spare per failure unless --no-spare")
    p.add_argument("--no-spare", action="store_true",
                   help="no hot spare: restart on the surviving nodes (fewer ranks), state resharded from their RAM")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default=None,
                   help="replicate the model (ddp) or shard it (fsdp, FSDP2); default: fsdp with --no-spare, else ddp")
    p.add_argument("--ranks-per-node", type=at_least(1), default=1)
    p.add_argument("--steps", type=at_least(5), default=120)
    p.add_argument("--save-every", type=at_least(1), default=5)
    p.add_argument("--persistent-every", type=at_least(1), default=4, help="every Nth checkpoint also goes to tier 2")
    p.add_argument("--persistent-bandwidth", type=float, default=50.0, help="MB/s of the persistent tier in the what-if restore")
    p.add_argument("--failures", type=at_least(1), default=1, help="node failures to inject (one after another)")
    p.add_argument("--dim", type=at_least(8), default=128, help="model width (state grows with its square)")
    p.add_argument("--layers", type=at_least(1), default=4)
    p.add_argument("--seed", type=int, default=None, help="fixes the failure step and node")
    p.add_argument("--timeline", default="incluster-demo-timeline.png", help="PNG timeline of the run")
    p.add_argument("--keep-files", action="store_true", help="leave the node folders for `incluster ls`")
    p.set_defaults(func=run)


def _reports(folder: str, world: int) -> dict[int, dict[str, Any]]:
    out = {}
    for r in range(world):
        try:
            with open(os.path.join(folder, f"rank-{r}.json")) as f:
                out[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return out


def _progress(folder: str, world: int) -> tuple[int, int]:
    """The step every rank has trained, and the newest step durable on every rank (-1: none)."""
    reps = _reports(folder, world)
    if len(reps) < world:
        return -1, -1
    steps = [max(map(int, r["losses"]), default=-1) for r in reps.values() if r.get("losses")]
    return (min(steps) if len(steps) == world else -1), min(r.get("durable", -1) for r in reps.values())


def _stop(job: Job, grace: float = 3.0) -> None:
    """What an elastic agent does to the survivors: SIGTERM, then SIGKILL."""
    for p in job.procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in job.procs):
        time.sleep(0.05)
    job.kill_all()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    con = Console()
    rng = random.Random(args.seed)
    if args.steps < 2 * args.save_every + 3:  # a node is lost after the second save, then training goes on
        con.print(f"[red]--steps must be at least 2 x --save-every + 3 ({2 * args.save_every + 3}): a node is lost "
                  f"after two saves[/]")
        return 2
    if not args.persistent_bandwidth > 0:
        con.print("[red]--persistent-bandwidth must be > 0 (MB/s)[/]")
        return 2
    if args.no_spare and args.nodes - args.failures < 2:
        con.print(f"[red]--no-spare needs at least 2 nodes left after {args.failures} failure(s): use --nodes {args.failures + 2} or more[/]")
        return 2
    parallel = args.parallel = args.parallel or ("fsdp" if args.no_spare else "ddp")
    names = [chr(ord("A") + i) for i in range(args.nodes + (0 if args.no_spare else args.failures))]
    nodes, spares = names[: args.nodes], names[args.nodes :]
    base = tempfile.mkdtemp(prefix="incluster-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    persistent = tempfile.mkdtemp(prefix="incluster-demo-persistent-")
    run_dir = os.path.join(base, "events")
    common = [SCRIPT, "--steps", str(args.steps), "--save-every", str(args.save_every),
              "--persistent", persistent, "--persistent-every", str(args.persistent_every),
              "--dim", str(args.dim), "--layers", str(args.layers), "--run-dir", run_dir]
    common += ["--fsdp"] if parallel == "fsdp" else []
    env = {"INCLUSTER_JOB": "demo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    spare_text = "no hot spare" if args.no_spare else f"hot spare(s) {', '.join(spares)}"
    con.print(f"[bold]incluster demo[/]: {args.nodes} nodes x {args.ranks_per_node} rank(s) "
              f"({'FSDP2, state sharded' if parallel == 'fsdp' else 'DDP, state replicated'}), {spare_text}; "
              f"RAM folders under {base}, persistent tier {persistent}")
    phases: list[dict[str, Any]] = []
    whatif: dict[str, Any] = {}
    whatif_layout: list[str] = []
    try:
        layout = list(nodes)
        for attempt in range(args.failures + 1):
            last = attempt == args.failures
            world = len(layout) * args.ranks_per_node
            folder = os.path.join(base, f"reports-{attempt}")
            os.makedirs(folder)
            job = launch(common + ["--report", folder], nodes=layout, ranks_per_node=args.ranks_per_node,
                         base_dir=base, env=env)
            kill_at = None if last else rng.randint(2 * args.save_every + 1, max(2 * args.save_every + 2, int(args.steps * 0.6)))
            victim = None if last else rng.choice([n for n in layout])
            phase = _watch(con, job, folder, world, layout, kill_at, victim, base, args.steps)
            phase["world"] = world
            phases.append(phase)
            if phase.get("failed"):
                return 1
            if last:
                break
            survivors = [n for n in layout if n != victim]
            if args.no_spare:
                con.print(f"[yellow]node {victim} lost (SIGKILL, RAM folder gone) at step {phase['progress']}[/]; "
                          f"no spare: the job restarts on the {len(survivors)} surviving nodes {' '.join(survivors)} "
                          f"({world} -> {len(survivors) * args.ranks_per_node} ranks), the state resharded from their RAM")
                layout = survivors
            else:
                layout = _replace(con, rng, layout, victim, spares[attempt], phase["progress"])
            if attempt == 0:  # the persistent tier as it is at this failure, for the what-if
                shutil.copytree(persistent, os.path.join(persistent + "-at-failure"))
                whatif_layout = list(layout)
        if whatif_layout:  # measured after the run, so the run's own timeline stays true
            whatif = _whatif(con, common, base, whatif_layout, args, env, len(whatif_layout) * args.ranks_per_node,
                             persistent + "-at-failure")
        from incluster.demo.report import render

        render(con, phases, whatif, run_dir, args, persistent)
        ok = all(p.get("bitwise", True) and p.get("loss_same", True) and p.get("resharded", True) for p in phases[1:])
        return 0 if ok else 1
    finally:
        if args.keep_files:
            con.print(f"files kept: {base} (RAM folders) and {persistent}")
        else:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(persistent, ignore_errors=True)
            shutil.rmtree(persistent + "-at-failure", ignore_errors=True)


def _replace(con: Any, rng: random.Random, layout: list[str], victim: str | None, spare: str, progress: int) -> list[str]:
    """The spare takes the victim's place and two surviving nodes swap positions (with
    fewer than two survivors, none do)."""
    layout = [spare if n == victim else n for n in layout]
    swap = ""
    if len(layout) >= 3:
        a, b = rng.sample([i for i, n in enumerate(layout) if n != spare], 2)
        layout[a], layout[b] = layout[b], layout[a]
        swap = f", {layout[b]} and {layout[a]} swap positions"
    con.print(f"[yellow]node {victim} lost (SIGKILL, RAM folder gone) at step {progress}[/]; "
              f"spare {spare} takes its place{swap}: {' '.join(layout)}")
    return layout


def _watch(con: Any, job: Job, folder: str, world: int, layout: list[str], kill_at: int | None,
           victim: str | None, base: str, steps: int) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.monotonic()
    label = f"{'training' if kill_at is None else 'training until a node fails'} on {' '.join(layout)}"
    phase: dict[str, Any] = {"layout": list(layout), "victim": victim, "t0": t0}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                  TimeElapsedColumn(), console=con, transient=False) as bar:
        task = bar.add_task(label, total=steps)
        while True:
            step, durable = _progress(folder, world)
            bar.update(task, completed=max(step + 1, 0))
            # Lost only once a save is durable: before, there would be nothing to recover
            # (the first saves may be given up while the writer processes start).
            if kill_at is not None and step >= kill_at and durable >= 0:
                for r, n in enumerate(job.nodes):
                    if n == victim:
                        job.kill(r)
                shutil.rmtree(os.path.join(base, str(victim)), ignore_errors=True)
                phase["progress"] = step
                _stop(job)
                break
            codes = [p.poll() for p in job.procs]
            if all(c is not None for c in codes):
                if any(c != 0 for c in codes):
                    bad = next(r for r, c in enumerate(codes) if c != 0)
                    con.print(f"[red]rank {bad} failed (exit {codes[bad]}); its log:[/]")
                    con.print(job.output(bad)[-3000:], markup=False, highlight=False)  # logs hold '[...]'
                    phase["failed"] = True
                phase["progress"] = step
                if kill_at is not None and not phase.get("failed"):  # it ended before the node could be lost
                    con.print(f"[red]training ended before a checkpoint was durable on every rank in time for the "
                              f"node loss (saves made while the writer processes start may be given up), so no node "
                              f"was lost; run more steps (--steps, now {steps})[/]")
                    phase["failed"] = True
                break
            if time.monotonic() - t0 > 600:
                job.kill_all()
                con.print("[red]the demo did not finish within 10 minutes[/]")
                phase["failed"] = True
                break
            time.sleep(0.1)
    phase["seconds"] = time.monotonic() - t0
    phase["reports"] = _reports(folder, world)
    return phase


def _whatif(con: Any, common: list[str], base: str, layout: list[str], args: argparse.Namespace,
            env: dict[str, str], world: int, persistent: str) -> dict[str, Any]:
    """Restore the post-failure layout from the persistent tier alone (as it was at the
    failure), at the given bandwidth, into empty RAM folders."""
    whatif_base = os.path.join(base, "whatif")
    folder = os.path.join(whatif_base, "reports")
    os.makedirs(folder)
    con.print(f"measuring the what-if: the same failure restored from the persistent tier alone (as it "
              f"was at the failure), at {args.persistent_bandwidth:.0f} MB/s …")
    cmd = common + ["--report", folder, "--restore-only", "--persistent-bandwidth", str(args.persistent_bandwidth)]
    cmd[cmd.index("--run-dir") + 1] = os.path.join(whatif_base, "events")
    cmd[cmd.index("--persistent") + 1] = persistent
    job = launch(cmd, nodes=layout, ranks_per_node=args.ranks_per_node, base_dir=whatif_base,
                 env={**env, "INCLUSTER_JOB": "demo"})
    try:
        codes = job.wait(300)
    except TimeoutError:
        return {"failed": True}
    reps = _reports(folder, world)
    if any(codes) or len(reps) < world:
        return {"failed": True, "log": job.output(0)[-2000:]}
    return {"reports": reps}


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    a = p.parse_args(["demo", *sys.argv[1:]])
    sys.exit(a.func(a))
