"""The crash campaign's verdicts: what a restore should have returned, and what it did.

Ground truth comes from two places the library does not control:

- the job's own event logs (``campaign_trainer``): the digest of the state handed to each
  ``save()``, written before the call, and what each rank loaded after a restart;
- the files on every node (and in the persistent tier) at restart time: which
  ``(rank, step)`` copies have a commit marker, minus the copy the campaign corrupted.

The newest step with a copy of every rank's shard is what a restore must return. Less is
data lost; more (or ranks that disagree, or a digest that differs) is a torn restore.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

_SIDECAR = re.compile(r"^step-(\d{12,})\.json$")
_STEP_DIR = re.compile(r"^step-(\d{12,})$")


def read_events(out: str, rank: int, run: int) -> list[dict[str, Any]]:
    path = os.path.join(out, f"r{rank}-run{run}.jsonl")
    if not os.path.exists(path):
        return []
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except ValueError:
                break  # a line cut by a SIGKILL is the last one
    return events


def copies_on_disk(base: str, nodes: list[str], job: str, persist: str | None) -> set[tuple[int, int, str]]:
    """(rank, step, where) for every committed copy: a sidecar next to its shard in a
    node's folder, or a rank listed in a persistent step's manifest."""
    out: set[tuple[int, int, str]] = set()
    for node in nodes:
        root = os.path.join(base, node, job)
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if not (name.startswith("rank-") and name[5:].isdigit()):
                continue
            folder = os.path.join(root, name)
            for f in os.listdir(folder):
                m = _SIDECAR.match(f)
                if m and os.path.exists(os.path.join(folder, f[: -len(".json")] + ".safetensors")):
                    out.add((int(name[5:]), int(m.group(1)), f"{node}/{name}/{f}"))
    proot = os.path.join(persist, job) if persist else ""
    for name in os.listdir(proot) if proot and os.path.isdir(proot) else []:
        m = _STEP_DIR.match(name)
        manifest = os.path.join(proot, name, "COMMITTED.json")
        if m and os.path.exists(manifest):
            try:
                ranks = [int(r["rank"]) for r in json.load(open(manifest, encoding="utf-8"))["ranks"]]
            except (ValueError, KeyError, TypeError):
                continue  # an unreadable manifest is no copy
            for r in ranks:
                out.add((r, int(m.group(1)), f"persist/{name}"))
    return out


def newest_complete(copies: set[tuple[int, int, str]], world: int, bad: set[str] = frozenset()) -> int | None:  # type: ignore[assignment]
    """The newest step with a good copy of every rank's shard; ``bad`` names corrupted
    copies (by their ``where``, or a prefix of it)."""
    holders: dict[int, set[int]] = {}
    for rank, step, where in copies:
        if not any(where.startswith(b) for b in bad):
            holders.setdefault(step, set()).add(rank)
    done = [s for s, ranks in holders.items() if ranks >= set(range(world))]
    return max(done) if done else None


def saved_digests(out: str, world: int, runs: list[int]) -> dict[tuple[int, int], str]:
    """(rank, step) -> digest of the latest run that handed that step to ``save()``: a
    later run re-saving a step number starts a new timeline, abandoning the old one."""
    digests: dict[tuple[int, int], str] = {}
    for run in runs:
        for rank in range(world):
            for e in read_events(out, rank, run):
                if e["event"] == "saving":
                    digests[(rank, int(e["step"]))] = e["digest"]
    return digests


@dataclass
class Verdict:
    expected: int | None
    restored: int | None = None
    correct: bool = False
    torn: bool = False
    lost: bool = False
    notes: list[str] = field(default_factory=list)


def judge_restore(out: str, world: int, run: int, expected: int | None,
                  digests: dict[tuple[int, int], str], upper: int | None = None) -> Verdict:
    """Compare every rank's restore in ``run`` with the saved digests and ``expected``,
    the newest complete step without the corrupted copy. ``upper`` is the newest counting
    it: a corruption that changed nothing a reader checks (a flipped timestamp digit)
    may still be restored, and the digest proves it harmless."""
    v = Verdict(expected)
    upper = expected if upper is None or (expected is not None and upper < expected) else upper
    loaded: dict[int, Any] = {}
    for rank in range(world):
        events = read_events(out, rank, run)
        got = next((e for e in events if e["event"] in ("loaded", "load_error")), None)
        if got is None:
            v.notes.append(f"rank {rank} never finished its restore")
            v.lost = True
            continue
        if got["event"] == "load_error":
            if expected is not None:
                v.lost = True
                v.notes.append(f"rank {rank} failed ({got['kind']}: {got['message'][:200]}) though step {expected} was complete")
            continue
        loaded[rank] = got
    steps = {g["step"] for g in loaded.values()}
    if len(steps) > 1:
        v.torn = True
        v.notes.append(f"ranks restored different steps: {sorted(steps, key=str)}")
    for rank, g in loaded.items():
        step = g["step"]
        v.restored = step
        if step is None:
            if expected is not None:
                v.lost = True
                v.notes.append(f"rank {rank} started afresh though step {expected} was complete")
            continue
        want = digests.get((rank, step))
        if want is None or g["digest"] != want:
            v.torn = True
            v.notes.append(f"rank {rank}: restored step {step} is not bitwise what was saved")
        if upper is None or step > upper:
            v.torn = True
            v.notes.append(f"rank {rank} restored step {step}, newer than the newest complete step {upper}")
        elif expected is not None and step < expected:
            v.lost = True
            v.notes.append(f"rank {rank} restored step {step} though step {expected} was complete")
    v.correct = not (v.torn or v.lost)
    return v
