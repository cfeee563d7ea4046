"""Launch a simulated multi-node job on one machine: real processes, real gloo.

Each rank is a separate Python process with the environment torchrun would give it
(``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) plus the node it
lives on: ``INCLUSTER_NODE`` and its own RAM folder ``INCLUSTER_LOCAL_DIR``. Used by the
test suite and the demo; usable in your own tests.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

_zygote: Any = None  # a testing.zygote.Zygote that forks ranks, or None: fresh interpreters


def use_zygote(zygote: Any) -> None:
    """Start later ranks by forking ``zygote`` (an :class:`incluster.testing.zygote.Zygote`,
    which imported torch once) instead of a fresh interpreter each; None turns it off.
    For test suites: each rank is still a process of its own."""
    global _zygote
    _zygote = zygote


_handed: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: every outgoing connection and
    every ``bind(port 0)`` (gloo's listeners, a store's clients) takes a port from that
    range, and one could take a port picked there before the rank meant to listen on it
    binds it. Never the same port twice in one process."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), max(1025, low - 1))
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:  # nothing free below the range: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    procs: list[Any]  # subprocess.Popen, or zygote.ZygoteChild (the same interface)
    logs: list[str]
    nodes: list[str]
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of every rank; kills everything still running at the deadline."""
        deadline = time.monotonic() + timeout
        codes: list[int] = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise TimeoutError(f"ranks still running after {timeout:.0f} s; logs: {self.logs}") from None
        return codes

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def output(self, rank: int) -> str:
        with open(self.logs[rank], encoding="utf-8", errors="replace") as f:
            return f.read()


def launch(
    argv: Sequence[str],
    *,
    nodes: Sequence[str],
    ranks_per_node: int,
    base_dir: str,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
) -> Job:
    """Start ``len(nodes) * ranks_per_node`` ranks of ``python argv...``: ``argv`` is the
    script and its arguments (``["train.py", "--steps", "10"]``), run by this Python.

    Rank r runs on node ``nodes[r // ranks_per_node]``, whose RAM folder is
    ``base_dir/<node>``; its output goes to ``base_dir/.logs/rank-<r>.log``
    (:meth:`Job.output`), beside the node folders, not among them. ``rank_env`` adds
    variables for single ranks (e.g. faults).
    """
    first = str(argv[0]) if argv else ""
    if first and (os.path.realpath(first) == os.path.realpath(sys.executable)
                  or re.fullmatch(r"python[0-9.]*", os.path.basename(first))):
        raise ValueError(f"launch() runs argv with this Python: pass the script and its arguments, without "
                         f"{argv[0]!r} first (e.g. launch(['train.py', ...], ...))")
    world = len(nodes) * ranks_per_node
    logs_dir = os.path.join(base_dir, ".logs")
    os.makedirs(logs_dir, mode=0o700, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        node = nodes[rank // ranks_per_node]
        folder = os.path.join(base_dir, node)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        e = dict(os.environ)
        e.update(env or {})
        e.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % ranks_per_node),
            LOCAL_WORLD_SIZE=str(ranks_per_node),
            INCLUSTER_NODE=node,
            INCLUSTER_LOCAL_DIR=folder,
        )
        e.update((rank_env or {}).get(rank, {}))
        log = os.path.join(logs_dir, f"rank-{rank}.log")
        if _zygote is not None:
            open(log, "wb").close()  # there even if the rank dies before it opens it
            procs.append(_zygote.spawn(argv, env=e, log=log))
        else:
            with open(log, "wb") as out:
                procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)
    return Job(procs, logs, [nodes[r // ranks_per_node] for r in range(world)])
