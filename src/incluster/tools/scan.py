"""Find every stored copy of every shard under the folders and URLs an operator names.

Used by ``incluster ls``, ``verify`` and ``export``. Read-only: nothing here writes,
renames or deletes. A path may be a node's RAM folder (``<local_dir>``, holding
``<job>/rank-RRRRR/``), a job folder, a folder of node folders (the simulated cluster),
or a persistent-tier root or job folder (``<job>/step-N/rank-RRRRR.{safetensors,json}``
with ``COMMITTED.json``), given as a path or an fsspec URL.

Scanning reads sidecars and manifests only; :func:`open_copy` checks a copy's bytes.
A copy whose sidecar cannot be read is kept with its ``error`` (a fault); files that a
crash or a spare slot leave behind are :class:`Note`\\ s (harmless, informational).
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any

from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.format.sidecar import Sidecar, read_sidecar
from incluster.tier_layout import MANIFEST
from incluster.staging.slots import STAGING_PREFIX
from incluster.tiers.local import ShardReader, data_path
from incluster.tools.models import Copy, Inventory, Note, size_damage
from incluster.tools.remote import BytesShard, scan_persistent

_RANK_DIR = re.compile(r"^rank-(\d{5})$")
_STEP_DIR = re.compile(r"^step-(\d{12,})$")
_SIDECAR = re.compile(r"^step-(\d{12,})\.json$")
_SHARD = re.compile(r"^step-(\d{12,})\.safetensors$")
_SEARCH_DEPTH = 3  # DIR, DIR/node, DIR/node/job: deep enough for a folder of node folders


def scan(paths: list[str], persistent: list[str] | None = None, job: str | None = None) -> Inventory:
    """Every copy under ``paths`` (local folders or URLs) and ``persistent`` URLs."""
    inv = Inventory()
    for p in paths:
        if "://" in p:
            scan_persistent(p, inv)
            continue
        if not os.path.isdir(p):
            if not os.path.exists(p):
                from incluster.tiers.persistent import check_url

                check_url(p)  # "s3:/bucket/x": names the fix, not a missing folder named "s3:"
            what = "a file, not a folder" if os.path.exists(p) else "no such folder"
            raise CheckpointError(f"{p}: {what}; name a node's RAM folder (e.g. /dev/shm/incluster) or a job folder")
        found = 0
        for kind, folder in _find(os.path.abspath(p)):
            found += 1
            if kind == "local":
                _scan_job(folder, inv)
            else:
                scan_persistent(folder, inv)
        if not found:
            inv.notes.append(Note(p, "no incluster job folder (rank-RRRRR/ or step-N/) found here"))
    for url in persistent or []:
        scan_persistent(url, inv)
    inv.jobs = {c.job for c in inv.copies} | {f[0] for f in inv.folders}
    if job is not None:
        inv.folders = {f for f in inv.folders if f[0] == job}
        inv.copies = [c for c in inv.copies if c.job == job]
        inv.problems = [p for p in inv.problems if p[0] == job]
    inv.set_aside_other_timelines()
    return inv


def _find(root: str) -> list[tuple[str, str]]:
    """Job folders under ``root``: ("local", path) with rank folders, ("persistent", path) with step folders."""
    out: list[tuple[str, str]] = []
    level = [root]
    for _ in range(_SEARCH_DEPTH):
        nxt: list[str] = []
        for d in level:
            try:
                subs = sorted(e.name for e in os.scandir(d) if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
            except OSError:
                continue
            if any(_RANK_DIR.match(s) for s in subs):
                out.append(("local", d))
            elif any(_STEP_DIR.match(s) for s in subs):
                out.append(("persistent", d))
            else:
                nxt.extend(os.path.join(d, s) for s in subs)
        level = nxt
    return out


def _scan_job(folder: str, inv: Inventory) -> None:
    job = os.path.basename(folder)
    first = len(inv.copies)
    for name in sorted(os.listdir(folder)):
        m = _RANK_DIR.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            _scan_rank(os.path.join(folder, name), job, int(m.group(1)), inv)
    unread = [c for c in inv.copies[first:] if c.sidecar is None]
    if unread:
        node = _node_of(folder, inv.copies[first:])
        for c in unread:
            c.node = node


def _node_of(folder: str, copies: list[Copy]) -> str | None:
    """The node whose RAM holds ``folder`` (a job folder), for copies whose own record
    cannot say: what the folder's readable records name, else the ranks' node records
    (``<job>/.node-RRRRR``, written by multi-rank runs)."""
    named = collections.Counter(c.holder for c in copies if c.sidecar is not None)
    if named:
        return named.most_common(1)[0][0]
    for name in sorted(os.listdir(folder)):
        if name.startswith(".node-"):
            try:
                with open(os.path.join(folder, name)) as f:
                    lines = f.read().split("\n")
            except OSError:
                continue
            if len(lines) > 1 and lines[1]:
                return lines[1]
    return None


def _scan_rank(folder: str, job: str, rank: int, inv: Inventory) -> None:
    inv.folders.add((job, rank))
    names = set(os.listdir(folder))
    for name in sorted(names):
        full = os.path.join(folder, name)
        if m := _SIDECAR.match(name):
            step = int(m.group(1))
            copy = Copy(job, step, rank, "ram", full, folder=folder)
            try:
                sc = read_sidecar(full)
                if (sc.job, sc.rank, sc.step) != (job, rank, step):
                    raise CorruptCheckpointError(
                        f"{full}: sidecar describes job {sc.job!r} rank {sc.rank} step {sc.step} but lies in "
                        f"the folder of job {job!r} rank {rank} step {step} (moved or renamed by hand?)"
                    )
                copy.sidecar = sc
                copy.tier = "replica" if "replica_on" in sc.extra else "ram"
                shard = data_path(folder, sc)
                if (why := _superseded_share(shard, sc)) is not None:
                    inv.notes.append(Note(full, why))
                    continue
                copy.damage = size_damage(shard, os.path.getsize(shard) if os.path.isfile(shard) else None, sc)
            except CorruptCheckpointError as exc:
                copy.error = str(exc)
            inv.copies.append(copy)
        elif name.endswith(".json.bad") and _SIDECAR.match(name[: -len(".bad")]):
            inv.notes.append(Note(full, "the commit record of a copy a restore found bad, set aside (kept until the "
                                        "step goes: a restore may forward it to where identical bytes are)"))
        elif (m := _SHARD.match(name)) and f"step-{m.group(1)}.json" not in names:
            if f"step-{m.group(1)}.json.bad" in names:
                inv.notes.append(Note(full, "a shard a restore found bad (its record set aside; reclaimed on restart)"))
            else:
                inv.notes.append(Note(full, "shard without a sidecar: a save that never committed (ignored, reclaimed "
                                            "on restart)"))
        elif name.startswith(STAGING_PREFIX):
            inv.notes.append(Note(full, "staging slot: a spare save slot or a torn save (harmless, reused)"))
        elif ".json.tmp-" in name:
            inv.notes.append(Note(full, "half-written sidecar from a crash (harmless, removed on restart)"))
        elif not _SHARD.match(name):
            inv.notes.append(Note(full, "unknown file (not part of any checkpoint)"))


def _superseded_share(shard: str, sc: Sidecar) -> str | None:
    """Why a shared copy (its bytes are a peer's own shard, see :mod:`incluster.replication`)
    is not a copy any more, or None. Its holder reuses the slot of an old step for a newer
    save before the step's shared records go (they go once that save is committed on every
    rank): the holder's record of the step is gone and a newer one is there. A holder whose
    record is there but whose shard is not is damage, judged as any copy."""
    peer = sc.extra.get("shared_with")
    if type(peer) is not int or os.path.isfile(shard):
        return None
    holder = os.path.dirname(shard)
    try:
        names = os.listdir(holder)
    except OSError:
        return None
    steps = {int(m.group(1)) for n in names if (m := _SIDECAR.match(n))}
    if sc.step in steps or not any(s > sc.step for s in steps):
        return None
    return (f"a shared copy of rank {sc.rank} step {sc.step} whose bytes were rank {peer}'s own shard, which "
            f"rank {peer} has since reused for a newer save: superseded (this record goes once that save is "
            f"committed everywhere; not a fault)")


def open_copy(copy: Copy) -> Any:
    """Read a copy, verifying every checksum and the header; CorruptCheckpointError if bad.

    Returns a reader with ``sidecar``, ``header``, ``tensor(name)`` and ``close()``.
    """
    if copy.error is not None or copy.sidecar is None:
        raise CorruptCheckpointError(copy.error or f"{copy.where}: no sidecar")
    if copy.remote is not None:
        if copy.manifest_checksum is not None and copy.manifest_checksum != copy.sidecar.checksum.to_json():
            raise CorruptCheckpointError(f"{copy.where}: checksums differ from those in {MANIFEST}")
        reader: Any = BytesShard(copy)
    else:
        reader = ShardReader(copy.folder, copy.step, verify_checksum=True)
    try:
        _check_tree(reader, copy.sidecar.tree)
    except BaseException:
        reader.close()
        raise
    return reader


def _check_tree(reader: Any, node: Any) -> None:
    """Every tensor the tree names exists in the shard, DTensor shards with their recorded shape."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, dict):
            continue
        for tag in ("T", "D", "P"):
            if tag in n:
                t = reader.header.tensors.get(n[tag])
                if t is None:
                    raise CorruptCheckpointError(f"{reader.path}: the state tree names tensor {n[tag]!r} but the shard lacks it")
                if tag == "D" and list(t.shape) != list(n.get("local_shape", t.shape)):
                    raise CorruptCheckpointError(f"{reader.path}: DTensor shard {n[tag]!r} is {list(t.shape)} but its tree says {n['local_shape']}")
        for tag in ("l", "t"):
            if isinstance(n.get(tag), list):
                stack.extend(n[tag])
        if isinstance(n.get("d"), list):
            stack.extend(item[1] for item in n["d"] if isinstance(item, list) and len(item) == 2)
        if "S" in n:
            stack.append(n.get("v"))
