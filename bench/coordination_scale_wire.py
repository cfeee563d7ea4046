"""``bench/coordination_scale.py``'s wire counters: the kernel's per-socket TCP statistics
(``ss -ti``) summed over one rank's processes, before and after a save."""

from __future__ import annotations

import re
import subprocess
from typing import Any

_ADDR = re.compile(r"^\s*\d+\s+\d+\s+(\S+)\s+(\S+)(.*)$")
_PID = re.compile(r"pid=(\d+),")
_FIELDS = ("bytes_sent", "bytes_received", "data_segs_out", "data_segs_in")
_FIELD_RE = {f: re.compile(rf"\b{f}:(\d+)") for f in _FIELDS}
_KINDS = ("server", "client", "gloo")


def _port(addr: str) -> int:
    try:
        return int(addr.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return -1


def tcp_sockets() -> list[dict[str, Any]]:
    """Every established TCP socket on this machine with its owner pids and counters."""
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, timeout=60
    ).stdout
    socks: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace() or (cur is None):
            m = _ADDR.match(line)
            if m is None:
                continue
            cur = {
                "lport": _port(m.group(1)),
                "rport": _port(m.group(2)),
                "pids": {int(p) for p in _PID.findall(m.group(3))},
                **{f: 0 for f in _FIELDS},
            }
            socks.append(cur)
        else:
            for f, rx in _FIELD_RE.items():
                mm = rx.search(line)
                if mm:
                    cur[f] = int(mm.group(1))
    return socks


def wire_snapshot(pids: set[int], exclude_ports: set[int], server_port: int | None) -> dict[str, dict[str, int]]:
    """Totals over this rank's sockets (its trainer and writer processes), excluding the
    benchmark's sync store: ``server`` = the job store's server side (local port
    ``server_port``), ``client`` = connections to the job store, ``gloo`` = the rest."""
    tot = {k: {**{f: 0 for f in _FIELDS}, "conns": 0} for k in _KINDS}
    for s in tcp_sockets():
        if not (s["pids"] & pids):
            continue
        if s["lport"] in exclude_ports or s["rport"] in exclude_ports:
            continue
        if server_port is not None and s["lport"] == server_port:
            kind = "server"
        elif server_port is not None and s["rport"] == server_port:
            kind = "client"
        else:
            kind = "gloo"
        for f in _FIELDS:
            tot[kind][f] += s[f]
        tot[kind]["conns"] += 1
    return tot


def wire_delta(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {
        k: {
            "msgs": (b[k]["data_segs_in"] - a[k]["data_segs_in"]) + (b[k]["data_segs_out"] - a[k]["data_segs_out"]),
            "bytes": (b[k]["bytes_received"] - a[k]["bytes_received"]) + (b[k]["bytes_sent"] - a[k]["bytes_sent"]),
            "conns": b[k]["conns"],  # open connections at the end of the save
        }
        for k in _KINDS
    }
