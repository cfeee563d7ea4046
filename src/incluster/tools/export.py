"""``incluster export DIR... --step N --to safetensors|torch|dcp OUT``: one full state dict.

Reads one verified copy of every rank's shard of step N (own copy first, then replicas,
then the persistent tier) and assembles a single state keyed by the flattened paths of
the sidecar trees (``model/layers.0.weight``, ``optim/state/0/exp_avg``):

- plain tensors: rank 0's, then any path only a later rank holds (data-parallel ranks
  all hold the same names; the first rank's copy is taken). A later rank's copy of up to
  ``COMPARED`` bytes, and every non-tensor value, is compared with the one taken: values
  that differ between ranks (an RNG state, a per-rank counter) are named in a warning;
- DTensor shards: placed into a tensor of ``global_shape`` at ``global_offset``
  (replicated copies are taken once); every element must be covered by some shard;
- other values (numbers, strings, ...): in ``OUT.json`` for safetensors, in the dict
  itself for ``torch``. Pickled objects stay ``uint8`` tensors (never unpickled here),
  named in a note.

Refuses, naming what is missing, a step that lacks a good copy of some rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from incluster.errors import CheckpointError
from incluster.format.dtypes import dtype_name
from incluster.format.layout import TensorSpec, build_layout
from incluster.state import escape_part
from incluster.tools.models import Copy, world_size
from incluster.tools.scan import open_copy
from incluster.tools.ui import consoles, human, line, load


COMPARED = 16 << 20  # a later rank's plain tensor up to this size is compared with the one exported


@dataclass
class Assembled:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    leaves: dict[str, Any] = field(default_factory=dict)
    pickled: list[str] = field(default_factory=list)
    diverged: dict[str, list[int]] = field(default_factory=dict)  # path -> later ranks whose value differs


class _Assembler:
    def __init__(self) -> None:
        self.out = Assembled()
        self.shards: dict[str, list[tuple[dict[str, Any], torch.Tensor, int]]] = {}

    def walk(self, node: Any, path: str, reader: Any, rank: int) -> None:
        if not isinstance(node, dict):
            raise CheckpointError(f"{reader.path}: malformed state tree at {path or '<root>'}")
        t = self.out.tensors
        if "T" in node or "P" in node:
            if path not in t and path not in self.shards:
                t[path] = reader.tensor(node.get("T", node.get("P")))
                if "P" in node:
                    self.out.pickled.append(path)
            elif path not in self.shards and "T" in node and t[path].nbytes <= COMPARED:
                mine = reader.tensor(node["T"])
                if mine.dtype != t[path].dtype or mine.shape != t[path].shape or not torch.equal(
                        mine.reshape(-1).view(torch.uint8), t[path].reshape(-1).view(torch.uint8)):
                    self.out.diverged.setdefault(path, []).append(rank)
        elif "D" in node:
            if path in t and path not in self.shards:
                raise CheckpointError(f"{path}: a DTensor on rank {rank} but a plain tensor on an earlier rank")
            t.setdefault(path, torch.empty(0))  # placeholder: keeps state order
            self.shards.setdefault(path, []).append((node, reader.tensor(node["D"]), rank))
        elif "S" in node:
            self.walk(node.get("v"), path, reader, rank)
        elif "d" in node:
            for key, child in node["d"]:
                self.walk(child, f"{path}/{escape_part(key)}" if path else escape_part(key), reader, rank)
            if not node["d"] and path:
                self.out.leaves.setdefault(path, {})
        elif "l" in node or "t" in node:
            items = node.get("l", node.get("t")) or []
            for i, child in enumerate(items):
                self.walk(child, f"{path}/{i}", reader, rank)
            if not items and path:
                self.out.leaves.setdefault(path, [])
        elif "v" in node or "f" in node:
            value = node["v"] if "v" in node else float(node["f"])
            taken = self.out.leaves.setdefault(path, value)
            if taken != value and not (taken != taken and value != value):  # NaN is NaN
                self.out.diverged.setdefault(path, []).append(rank)
        else:
            raise CheckpointError(f"{reader.path}: unknown state tree node at {path or '<root>'}: {sorted(node)}")

    def place(self) -> None:
        for path, parts in self.shards.items():
            self.out.tensors[path] = _place(path, parts)


def _place(path: str, parts: list[tuple[dict[str, Any], torch.Tensor, int]]) -> torch.Tensor:
    """One full tensor from DTensor shards at their global offsets."""
    first = parts[0][0]
    gshape, placements = list(first["global_shape"]), first["placements"]
    for node, _, rank in parts:
        if list(node["global_shape"]) != gshape or node["placements"] != placements:
            raise CheckpointError(f"{path}: rank {rank} describes global shape {node['global_shape']} / placements "
                                  f"{node['placements']}, rank {parts[0][2]} {gshape} / {placements}")
    for p in placements:
        if p[0] == "P":
            raise CheckpointError(f"{path}: a Partial (unreduced, {p[1]}) DTensor cannot be assembled from shards; "
                                  f"redistribute it to Replicate or Shard before saving")
        if p[0] not in ("S", "R"):
            raise CheckpointError(f"{path}: placement {p} is not supported by export (only Shard and Replicate)")
    full = torch.empty(gshape, dtype=parts[0][1].dtype)
    placed: dict[tuple[int, ...], tuple[int, ...]] = {}
    for node, shard, rank in parts:
        off, shape = tuple(node["global_offset"]), tuple(shard.shape)
        if len(off) != len(gshape) or any(o < 0 or o + s > g for o, s, g in zip(off, shape, gshape)):
            raise CheckpointError(f"{path}: rank {rank}'s shard {list(shape)} at offset {list(off)} lies outside {gshape}")
        if off in placed:
            if placed[off] != shape:
                raise CheckpointError(f"{path}: ranks hold different shards at offset {list(off)}")
            continue  # a replicated copy: take one
        placed[off] = shape
        full[tuple(slice(o, o + s) for o, s in zip(off, shape))].copy_(shard)
    covered, need = sum(math.prod(s) for s in placed.values()), math.prod(gshape)
    if covered != need:
        raise CheckpointError(f"{path}: the shards cover {covered} of {need} elements; a rank's shard is missing")
    return full


def assemble(readers: dict[int, Any]) -> Assembled:
    """One state from every rank's (verified) reader, rank 0 first."""
    a = _Assembler()
    for rank in sorted(readers):
        a.walk(readers[rank].sidecar.tree, "", readers[rank], rank)
    a.place()
    return a.out


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan", "inf", "-inf": strict JSON has no such numbers
    return v


def _write_atomic(path: str, write: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_safetensors(state: Assembled, out: str, meta: dict[str, Any]) -> list[str]:
    """A safetensors file laid out by the project's own layout code, plus ``OUT.json``."""
    names = list(state.tensors)
    specs = [TensorSpec(n, dtype_name(t.dtype, n), tuple(t.shape)) for n, t in state.tensors.items()]
    layout = build_layout(specs)

    def write(f: Any) -> None:
        f.write(layout.header)
        for e in sorted(layout.entries, key=lambda e: e.offset):
            if e.nbytes:
                t = state.tensors[e.spec.name].contiguous()
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)

    _write_atomic(out, write)
    side = {**meta, "tensors": len(names), "pickled": state.pickled,
            "leaves": {k: _json_value(v) for k, v in state.leaves.items()}}
    _write_atomic(f"{out}.json", lambda f: f.write(json.dumps(side, indent=1, allow_nan=False).encode()))
    return [out, f"{out}.json"]


def write_torch(state: Assembled, out: str) -> list[str]:
    # clone(): torch.save writes a view's whole storage, i.e. the whole mapped shard.
    obj: dict[str, Any] = {k: t.clone() for k, t in state.tensors.items()}
    obj.update(state.leaves)
    _write_atomic(out, lambda f: torch.save(obj, f))
    return [out]


def run(args: argparse.Namespace) -> int:
    out, err = consoles()
    if not args.dirs and not args.persistent:
        line(err, "[red]error:[/]", "name where the checkpoint is: one or more DIRs (a node's RAM folder, a job "
                                    "folder) or --persistent URL, before OUT")
        return 2
    if os.path.lexists(args.out):  # every format alike: an export never overwrites anything
        line(err, "[red]error:[/]", f"{args.out} already exists; remove it or choose another OUT")
        return 2
    inv = load(args, err)
    if inv is None:
        return 2
    jobs = sorted({c.job for c in inv.copies if c.step == args.step})
    if not jobs:
        have = sorted({c.step for c in inv.copies})
        line(out, "[red]refused:[/]", f"no step {args.step} found under {', '.join(args.dirs + args.persistent)}"
             + (f"; steps there: {', '.join(map(str, have[-12:]))}" if have
                else inv.elsewhere(args.job) or "; no steps there at all"))
        return 1
    if len(jobs) > 1:
        line(err, "[red]error:[/]", f"jobs {', '.join(jobs)} all have step {args.step}; choose one with --job")
        return 2
    job = jobs[0]
    ranks = inv.steps()[(job, args.step)]
    w, why = world_size(ranks)
    if w is None:
        line(out, "[red]refused:[/]", f"job {job} step {args.step}: {why}")
        return 1
    readers: dict[int, Any] = {}
    used: dict[int, Copy] = {}
    refusals: list[str] = []
    with err.status(f"verifying the shards of job {job} step {args.step}"):
        for r in range(w):
            reasons = []
            for c in ranks.get(r, []):
                try:
                    readers[r], used[r] = open_copy(c), c
                    break
                except (CheckpointError, OSError) as exc:
                    reasons.append(str(exc))
            if r not in readers:
                refusals.append(f"rank {r}: " + ("; ".join(reasons) if reasons else "no copy with a sidecar in any DIR or tier"))
    try:
        if refusals:
            line(out, "[red]refused:[/]", f"job {job} step {args.step} is incomplete or corrupt ({len(refusals)} of {w} ranks lack a good copy):")
            for text in refusals:
                line(out, "  [red]missing[/]", text)
            return 1
        try:
            state = assemble(readers)
            diverged, state_pickled = state.diverged, state.pickled
            meta = {"format": "incluster-export", "version": 1, "job": job, "step": args.step, "world_size": w,
                    "sources": {str(r): c.where for r, c in used.items()}}
            if args.to == "dcp":
                from incluster.tools.dcp_export import nested_state, write_dcp

                files = write_dcp(nested_state({r: rd.sidecar.tree for r, rd in readers.items()}, state), args.out)
            elif args.to == "safetensors":
                files = write_safetensors(state, args.out, meta)
            else:
                files = write_torch(state, args.out)
        except CheckpointError as exc:
            line(out, "[red]refused:[/]", str(exc))
            return 1
        except OSError as exc:  # FileExistsError included: a dcp folder is never overwritten
            line(err, "[red]error:[/]", f"cannot write {args.out}: {exc}")
            return 2
    finally:
        state = None  # type: ignore[assignment]  # drop views before unmapping
        for rd in readers.values():
            rd.close()
    if diverged:
        named = "; ".join(f"{p} (rank {', '.join(map(str, r))})" for p, r in list(diverged.items())[:8])
        line(err, "[yellow]warning:[/]", f"{len(diverged)} value(s) differ between ranks; the export holds the "
             f"first rank's of each, not these: {named}{' ...' if len(diverged) > 8 else ''} (tensors over "
             f"{human(COMPARED)} are not compared)")
    if state_pickled and args.to != "dcp":
        named = ", ".join(state_pickled[:8]) + (" ..." if len(state_pickled) > 8 else "")
        line(err, "[yellow]note:[/]", f"{len(state_pickled)} value(s) were pickled objects and are exported as "
             f"uint8 tensors of their pickled bytes, not unpickled: {named}; if you trust where the checkpoint "
             f"came from, pickle.loads(t.numpy().tobytes()) gives the object back")
    nbytes = sum(os.path.getsize(f) for f in files)
    for r, c in used.items():
        line(out, f"rank {r}:", f"{c.where} ({c.tier if c.tier == 'persistent' else f'{c.tier} on {c.holder}'})")
    line(out, "[green]exported[/]", f"job {job} step {args.step} (world size {w}) -> {' + '.join(files)} ({human(nbytes)})")
    return 0
