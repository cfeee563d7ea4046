"""The persistent tier as the operator tools see it: manifested steps and their copies.

Layout (see :mod:`incluster.tier_layout`): ``<root>/<job>/step-N/rank-RRRRR.{safetensors,json}``
plus ``COMMITTED.json``. Only manifested steps count; a step folder without a manifest
is an unfinished or failed upload (a :class:`Note`). Shards are read whole into memory
and checked exactly like RAM copies: size, every chunk checksum, the strict header.
"""

from __future__ import annotations

import json
import re

import torch

from incluster.errors import CorruptCheckpointError
from incluster.format.checksum import verify
from incluster.format.dtypes import NAME_TO_DTYPE
from incluster.format.reader import ShardHeader, header_length, parse_header
from incluster.format.sidecar import Sidecar
from incluster.tier_layout import MANIFEST, ROLLED_BACK, SET_ASIDE, list_steps, set_aside_reason, step_dir
from incluster.tiers.persistent import FsspecTier
from incluster.tools.models import Copy, Inventory, Note, size_damage

_STEP_DIR = re.compile(r"^step-(\d{12,})$")
_REMOTE_SIDECAR = re.compile(r"^rank-(\d{5})\.json$")


def _bytes(tier: FsspecTier, key: str) -> bytes:
    data = tier.read(key)
    if not isinstance(data, bytes):
        raise CorruptCheckpointError(f"{tier.url}/{key}: the tier returned no bytes")
    return data


def scan_persistent(url: str, inv: Inventory) -> None:
    url = url.rstrip("/")
    root_tier = FsspecTier(url)
    if any(_STEP_DIR.match(n) for n in root_tier.list("")):
        base, _, name = url.rpartition("/")
        jobs, tier = [name], FsspecTier(base or "/")
    else:
        jobs, tier = [n for n in root_tier.list("") if any(_STEP_DIR.match(s) for s in root_tier.list(n))], root_tier
    if not jobs:
        inv.notes.append(Note(url, "no persistent-tier job (<job>/step-N/ folders) found here"))
    for job in jobs:
        manifested = list_steps(tier, job)
        for name in tier.list(job):
            if not (m := _STEP_DIR.match(name)):
                continue
            step = int(m.group(1))
            d = step_dir(job, step)
            if step not in manifested:
                inv.notes.append(Note(f"{tier.url}/{d}", "upload without a COMMITTED.json manifest (unfinished or failed; ignored)"))
                continue
            if not manifested[step]:
                why = set_aside_reason(tier, job, step)
                by = "a rollback" if (why or "").startswith(ROLLED_BACK) else "a restore that found a copy bad"
                inv.notes.append(Note(f"{tier.url}/{d}", f"set aside by {by} ({why}); "
                                      f"restores pass over it (delete its {SET_ASIDE} to have it tried again)"))
                continue
            _scan_remote_step(tier, job, step, d, inv)


def _scan_remote_step(tier: FsspecTier, job: str, step: int, d: str, inv: Inventory) -> None:
    where = f"{tier.url}/{d}/{MANIFEST}"
    try:
        manifest = json.loads(_bytes(tier, f"{d}/{MANIFEST}"))
        listed = {int(r["rank"]): r["checksum"] for r in manifest["ranks"]}
        if manifest.get("job") != job or manifest.get("step") != step:
            raise ValueError(f"it describes job {manifest.get('job')!r} step {manifest.get('step')!r}")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        inv.problems.append((job, step, f"{where}: unreadable manifest ({exc}); this persistent step cannot be trusted"))
        return
    present = set()
    sizes = tier.list_sizes(d)
    for name in sorted(sizes):
        if not (m := _REMOTE_SIDECAR.match(name)):
            continue
        rank = int(m.group(1))
        present.add(rank)
        inv.folders.add((job, rank))
        copy = Copy(job, step, rank, "persistent", f"{tier.url}/{d}/{name}",
                    remote=(tier, f"{d}/rank-{rank:05d}.safetensors"), manifest_checksum=listed.get(rank))
        try:
            sc = Sidecar.from_json(json.loads(_bytes(tier, f"{d}/{name}")), copy.where)
            if (sc.job, sc.rank, sc.step) != (job, rank, step):
                raise CorruptCheckpointError(f"{copy.where}: sidecar describes job {sc.job!r} rank {sc.rank} step {sc.step}")
            copy.sidecar = sc
            shard = f"rank-{rank:05d}.safetensors"
            copy.damage = size_damage(f"{tier.url}/{d}/{shard}", sizes.get(shard), sc)
        except (ValueError, RecursionError) as exc:
            copy.error = f"{copy.where}: sidecar is not valid JSON ({exc})"
        except CorruptCheckpointError as exc:
            copy.error = str(exc)
        inv.copies.append(copy)
    inv.folders.update((job, r) for r in listed)  # a manifested step names every rank of its world
    for rank in sorted(set(listed) - present):
        inv.problems.append((job, step, f"{where}: lists rank {rank} but {tier.url}/{d}/rank-{rank:05d}.json is missing"))


class BytesShard:
    """A persistent copy read into memory and checked like :class:`ShardReader` checks a file."""

    def __init__(self, copy: Copy) -> None:
        if copy.remote is None or copy.sidecar is None:
            raise CorruptCheckpointError(copy.error or f"{copy.where}: no readable sidecar")
        tier, key = copy.remote
        self.sidecar = copy.sidecar
        self.path = f"{tier.url}/{key}"
        try:
            data = bytearray(_bytes(tier, key))
        except (OSError, FileNotFoundError) as exc:
            raise CorruptCheckpointError(f"{self.path}: cannot read shard ({exc})") from None
        verify(data, self.sidecar.checksum, self.path)
        n = header_length(bytes(data[:8]), len(data), self.path)
        self.header: ShardHeader = parse_header(bytes(data[: 8 + n]), len(data), self.path)
        self._buf = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.header.file_size

    def tensor(self, name: str) -> torch.Tensor:
        t = self.header.tensors.get(name)
        if t is None:
            raise CorruptCheckpointError(f"{self.path}: the state tree names tensor {name!r} but the shard lacks it")
        return self._buf[t.offset : t.offset + t.nbytes].view(NAME_TO_DTYPE[t.dtype]).view(t.shape)

    def close(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)
