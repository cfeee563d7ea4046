"""A seeded crash campaign: real processes, real SIGKILLs, real corruption, then restarts.

Each trial runs a 4-rank job (one rank per simulated node, or two on each of two nodes;
gloo, a persistent tier in a folder) that saves every 2 steps, injects one fault, restarts every rank (on the same
nodes, with a spare in a wiped node's place, or with two nodes swapped) and judges the
restore with :mod:`incluster.testing.judge`: bitwise what was saved, the newest step that
had a complete copy anywhere, and no process that outlives its deadline.

    results = run_campaign(trials=12, seed=0)
    summary(results)   # faults by kind, restores, bitwise-correct, torn, hangs, lost

The job is torn down the way torchrun does it: once any trainer dies, the others are
killed after a short (random) grace. A writer process's death does not end the job.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from incluster.testing import judge
from incluster.testing.faults import FaultInjector
from incluster.testing.launch import Job, launch

NODES = ["A", "B", "C", "D"]
SPARE = "E"
WORLD = len(NODES)
STEPS, EVERY = 6, 2
KINDS = (
    "kill-trainer@stage", "kill-writer@commit", "kill-writer@sidecar", "kill-writer@counted", "kill-writer@replicate",
    "kill-writer@upload", "kill-random", "kill-during-restore", "hang@replicate", "enospc@allocate",
    "corrupt-shard", "corrupt-replica", "corrupt-sidecar", "corrupt-manifest", "corrupt-persistent-shard",
    "step-during-staging", "raise@stage", "kill-random/2-per-node",
)


@dataclass
class Trial:
    index: int
    kind: str
    seed: int

    def describe(self) -> str:
        return f"trial {self.index} ({self.kind}, seed {self.seed})"


@dataclass
class Result:
    trial: Trial
    fault: str = ""
    restart: str = "same"
    verdict: judge.Verdict | None = None
    hang: bool = False
    checks: list[str] = field(default_factory=list)  # failed extra checks
    seconds: float = 0.0
    runs: list[float] = field(default_factory=list)  # seconds of each launch

    @property
    def ok(self) -> bool:
        v = self.verdict
        return v is not None and v.correct and not self.hang and not self.checks


def plan(trials: int, seed: int) -> list[Trial]:
    """Every kind once before any twice, in a seeded order."""
    rng = random.Random(seed)
    out: list[Trial] = []
    while len(out) < trials:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        base = len(out)
        out.extend([Trial(base + i, k, rng.randrange(2**31)) for i, k in enumerate(kinds[: trials - base])])
    return out


class _Run:
    """One launch of the job, watched: torchrun-like teardown, a deadline, outside kills."""

    def __init__(self, base: str, out: str, run: int, nodes: list[str], *, steps: int, env: dict[str, str],
                 rank_env: dict[int, dict[str, str]] | None = None) -> None:
        argv = ["-m", "incluster.testing.campaign_trainer", out, str(steps), str(EVERY), str(run)]
        self.out, self.run = out, run
        per_node = WORLD // len(nodes)
        self.job: Job = launch(argv, nodes=nodes, ranks_per_node=per_node, base_dir=base, env=env, rank_env=rank_env)

    def events(self, rank: int) -> list[dict[str, Any]]:
        return judge.read_events(self.out, rank, self.run)

    def watch(self, rng: random.Random, deadline_s: float, result: Result,
              kill: Callable[["_Run"], bool] | None = None) -> bool:
        """Wait for the job; True if a process outlived the deadline (a hang)."""
        t0 = time.monotonic()
        try:
            return self._watch(rng, deadline_s, kill)
        finally:
            result.runs.append(round(time.monotonic() - t0, 1))

    def failures(self) -> list[str]:
        """The last lines of each rank that did not exit cleanly."""
        out = []
        for r, p in enumerate(self.job.procs):
            if p.returncode != 0:
                tail = self.job.output(r).strip().splitlines()[-3:]
                out.append(f"run {self.run} rank {r} exit {p.returncode}: {' | '.join(tail)[-400:]}")
        return out

    def _watch(self, rng: random.Random, deadline_s: float, kill: Callable[["_Run"], bool] | None) -> bool:
        end = time.monotonic() + deadline_s
        teardown: float | None = None
        while time.monotonic() < end:
            if kill is not None and kill(self):
                kill = None
            codes = [p.poll() for p in self.job.procs]
            if all(c is not None for c in codes):
                return False
            if teardown is None and any(c not in (None, 0) for c in codes):
                teardown = time.monotonic() + rng.uniform(0.0, 1.0)  # torchrun notices, then kills
            if teardown is not None and time.monotonic() >= teardown:
                self.job.kill_all()
                return False
            time.sleep(0.02)
        self.job.kill_all()
        return True


def _random_kill(rng: random.Random, result: Result, writer: str) -> Callable[[_Run], bool]:
    """SIGKILL a random rank's trainer or writer at a random instant after all restored."""
    rank, delay = rng.randrange(WORLD), rng.uniform(0.0, 1.0)
    target = rng.choice(["trainer", "writer"]) if writer == "process" else "trainer"
    state: dict[str, float] = {}

    def step(run: _Run) -> bool:
        if "at" not in state:
            if all(any(e["event"] == "loaded" for e in run.events(r)) for r in range(WORLD)):
                state["at"] = time.monotonic() + delay
            return False
        if time.monotonic() < state["at"]:
            return False
        start = next((e for e in run.events(rank) if e["event"] == "start"), {})
        pid = start.get("pid" if target == "trainer" else "writer_pid")
        try:
            if not isinstance(pid, int) or pid <= 0:  # never 0 or -1: that would be a process group
                raise ProcessLookupError
            os.kill(pid, signal.SIGKILL)
            result.fault = f"SIGKILL rank {rank}'s {target} {delay:.2f} s into training"
        except ProcessLookupError:
            result.fault = f"rank {rank}'s {target} had already exited at {delay:.2f} s (no kill)"
        return True

    return step


def _flip_or_cut(path: str, rng: random.Random) -> str:
    size = os.path.getsize(path)
    if rng.random() < 0.5 and size > 0:
        off = rng.randrange(size)
        with open(path, "r+b") as f:
            f.seek(off)
            b = f.read(1)[0]
            f.seek(off)
            f.write(bytes([b ^ (1 << rng.randrange(8))]))
        return f"bit flip at byte {off} of {size}"
    cut = rng.randrange(size) if size else 0
    os.truncate(path, cut)
    return f"truncated to {cut} of {size} bytes"


def _corrupt(kind: str, base: str, persist: str, nodes: list[str], rng: random.Random) -> tuple[str, set[str], bool]:
    """Damage one copy; returns (what was done, the judge's 'bad' names, RAM wiped)."""
    copies = judge.copies_on_disk(base, nodes, "camp", persist)
    ram = sorted(c for c in copies if not c[2].startswith("persist/"))
    newest = max(s for _, s, _ in ram)
    if kind in ("corrupt-manifest", "corrupt-persistent-shard"):
        pstep = max(s for _, s, w in copies if w.startswith("persist/"))
        for node in nodes:
            shutil.rmtree(os.path.join(base, node), ignore_errors=True)  # a cluster-wide outage
        folder = os.path.join(persist, "camp", f"step-{pstep:012d}")
        name = "COMMITTED.json" if kind == "corrupt-manifest" else f"rank-{rng.randrange(WORLD):05d}.safetensors"
        how = _flip_or_cut(os.path.join(folder, name), rng)
        return f"{kind}: {name} of persistent step {pstep}, {how}; every node's RAM wiped", {f"persist/step-{pstep:012d}"}, True
    rank = rng.randrange(WORLD)
    own = f"{nodes[rank]}/rank-{rank:05d}/step-{newest:012d}.json"
    mine = [w for r, s, w in ram if r == rank and s == newest]
    if kind == "corrupt-shard":
        where = own
    elif kind == "corrupt-replica":
        where = rng.choice([w for w in mine if w != own] or mine)
    else:
        where = rng.choice(mine)
    path = os.path.join(base, where.split("/", 1)[0], "camp", where.split("/", 1)[1])
    if kind != "corrupt-sidecar":
        path = path[: -len(".json")] + ".safetensors"
    how = _flip_or_cut(path, rng)
    return f"{kind}: rank {rank}'s step {newest} at {where.rsplit('.', 1)[0]}, {how}", {where}, False


def _restart_nodes(nodes: list[str], rng: random.Random, base: str, lost: str | None, allow_wipe: bool) -> tuple[list[str], str]:
    choice = rng.choice(["same", "spare", "swap", "spare+swap"] if allow_wipe else ["same", "swap"])
    new = list(nodes)
    what = []
    if "spare" in choice:
        gone = lost or rng.choice(nodes)
        shutil.rmtree(os.path.join(base, gone), ignore_errors=True)
        new[new.index(gone)] = SPARE
        what.append(f"node {gone} lost, spare {SPARE} in its place")
    if "swap" in choice:
        i, j = rng.sample(range(len(new)), 2)
        new[i], new[j] = new[j], new[i]
        what.append(f"{new[j]} and {new[i]} swap places")
    return new, "; ".join(what) or "same nodes"


def run_trial(trial: Trial, root: str) -> Result:
    rng = random.Random(trial.seed)
    result = Result(trial)
    t0 = time.monotonic()
    base = tempfile.mkdtemp(prefix=f"incluster-campaign-{trial.index}-", dir=root)
    try:
        _trial_body(trial, rng, result, base)
    finally:
        result.seconds = time.monotonic() - t0
        shutil.rmtree(base, ignore_errors=True)
    return result


def _trial_body(trial: Trial, rng: random.Random, result: Result, base: str) -> None:
    out, persist = os.path.join(base, "out"), os.path.join(base, "persist")
    os.makedirs(out)
    kind = trial.kind
    writer = "process" if "writer" in kind or kind.startswith("hang") else rng.choice(["process", "thread"])
    env = {"WRITER": writer, "TIMEOUT_S": "5", "INCLUSTER_PERSISTENT": persist,
           "PYTHONUNBUFFERED": "1"}
    nodes = list(NODES) if not kind.endswith("2-per-node") else NODES[: WORLD // 2]  # two ranks on each node
    if kind == "step-during-staging":
        env["NO_WAIT"] = "1"  # the next optimizer step runs while each save stages
    rank_env: dict[int, dict[str, str]] = {}
    kill = None
    rank = rng.randrange(WORLD)
    step = rng.choice([2, 4, 6])
    if kind == "kill-writer@upload":
        step = rng.choice([2, 6])  # saves 1 and 3 upload
    elif kind == "enospc@allocate":
        step = 2  # slot files are allocated by the first save (and reused by every later one)
    elif kind == "raise@stage":
        step = rng.choice([2, 4])  # a later save must land
    if "@" in kind and kind != "kill-random":
        action, phase = kind.split("@")
        action = {"kill-trainer": "kill", "kill-writer": "kill"}.get(action, action)
        fi = FaultInjector().fail_at(phase=phase, rank=rank, step=step, action=action, marker_dir=out)
        rank_env[rank] = fi.env()
        result.fault = f"{action} at {phase}, rank {rank}, step {step} ({writer} writer)"
    elif kind in ("kill-random", "step-during-staging", "kill-random/2-per-node"):
        kill = _random_kill(rng, result, writer)
    first = _Run(base, out, 1, nodes, steps=STEPS, env=env, rank_env=rank_env)
    result.hang |= first.watch(rng, 150.0, result, kill)
    if kind == "enospc@allocate":
        _check_enospc(first, rank, step, result)
    if kind == "raise@stage":
        _check_refused(first, rank, step, result)
    bad: set[str] = set()
    lost = nodes[rank * len(nodes) // WORLD] if kind.startswith("kill") and kind != "kill-during-restore" else None
    if kind.startswith("corrupt"):
        result.fault, bad, wiped = _corrupt(kind, base, persist, nodes, rng)
        if not wiped:
            nodes, result.restart = _restart_nodes(nodes, rng, base, None, allow_wipe=False)
    else:
        nodes, result.restart = _restart_nodes(nodes, rng, base, lost, allow_wipe=True)
    run = 2
    if kind == "kill-during-restore":
        who = rng.randrange(WORLD)
        fi = FaultInjector().fail_at(phase="load-transfer", rank=who, action="kill")
        result.fault = f"SIGKILL of rank {who}'s trainer inside its restore"
        second = _Run(base, out, 2, nodes, steps=STEPS + 2, env=env, rank_env={who: fi.env()})
        result.hang |= second.watch(rng, 150.0, result)
        run = 3
    copies = judge.copies_on_disk(base, nodes, "camp", persist)
    expected = judge.newest_complete(copies, WORLD, bad)
    upper = judge.newest_complete(copies, WORLD)
    final = _Run(base, out, run, nodes, steps=STEPS + 2, env={**env, "TIMEOUT_S": "20"})
    result.hang |= final.watch(rng, 150.0, result)
    digests = judge.saved_digests(out, WORLD, list(range(1, run)))
    result.verdict = judge.judge_restore(out, WORLD, run, expected, digests, upper=upper)
    if not result.verdict.correct:
        result.verdict.notes.extend(final.failures())
    if result.hang or not result.ok:
        keep = os.environ.get("INCLUSTER_CAMPAIGN_KEEP")
        if keep:
            shutil.copytree(base, os.path.join(keep, os.path.basename(base)), dirs_exist_ok=True, ignore_dangling_symlinks=True)


def _check_enospc(run: _Run, rank: int, step: int, result: Result) -> None:
    """A full RAM disk fails that save with an error that names the fix; training goes on."""
    events = run.events(rank)
    err = next((e for e in events if e["event"] == "save_error" and e["step"] == step), None)
    if err is None or "free space" not in err["message"]:
        result.checks.append(f"rank {rank} step {step}: no clear 'free space' error ({err})")
    if not any(e["event"] == "durable" and e["step"] > step for e in events):
        result.checks.append(f"rank {rank}: no save after the full RAM disk became durable")


def _check_refused(run: _Run, rank: int, step: int, result: Result) -> None:
    """One rank's save fails: every rank learns the step failed, every rank's next save lands."""
    for r in range(WORLD):
        events = run.events(r)
        if not any(e["event"] == "save_error" and e["step"] == step for e in events):
            result.checks.append(f"rank {r}: step {step}, refused on rank {rank}, did not fail here")
        if not any(e["event"] == "durable" and e["step"] > step for e in events):
            result.checks.append(f"rank {r}: no save after step {step} became durable")


def run_campaign(trials: int, seed: int, root: str | None = None,
                 progress: Callable[[Result], None] | None = None) -> list[Result]:
    root = root or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    results = []
    for t in plan(trials, seed):
        r = run_trial(t, root)
        results.append(r)
        if progress is not None:
            progress(r)
    return results


def summary(results: list[Result]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        k = by_kind.setdefault(r.trial.kind, {"trials": 0, "correct": 0, "torn": 0, "lost": 0, "hangs": 0})
        v = r.verdict
        k["trials"] += 1
        k["correct"] += int(r.ok)
        k["torn"] += int(bool(v and v.torn))
        k["lost"] += int(bool(v and v.lost))
        k["hangs"] += int(r.hang)
    total = {key: sum(k[key] for k in by_kind.values()) for key in ("trials", "correct", "torn", "lost", "hangs")}
    return {"by_kind": by_kind, "total": total, "python": sys.version.split()[0]}
