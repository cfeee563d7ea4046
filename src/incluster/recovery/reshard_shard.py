"""The old shards of a resharding restore and the live DTensors they land in: opening and
checking them, the file bytes a piece spans, the tree rewritten for the new layout (see
:mod:`incluster.recovery.reshard` for the protocol)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from incluster import dtensor
from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.format.checksum import checksum_pool, digest
from incluster.format.dtypes import NAME_TO_DTYPE, dtype_name
from incluster.format.reader import ShardHeader
from incluster.recovery.boxes import Box, Layout, coord_of, local_slices, numel
from incluster.state_load import live_dtensors, live_targets
from incluster.tiers.local import ShardReader, rank_folder


@dataclass
class Shard:
    """An old rank's shard as one rank sees it: its tree, header, and DTensor layouts."""

    owner: int
    sidecar_raw: bytes
    tree: Any
    header: ShardHeader
    old: dict[str, Layout]  # every DTensor's layout when it was saved
    saved: dict[str, Box]  # the box this shard recorded for each
    reader: ShardReader | None = None  # only for shards this rank serves

    def rest(self) -> list[str]:
        """Tensors the placements do not cut (plain tensors, pickled leaves), file order."""
        names = _tensor_names(self.tree) - set(self.old)
        return sorted(names, key=lambda n: self.header.tensors[n].offset)


@dataclass
class Live:
    """This rank's live DTensors, as the new layout."""

    new: dict[str, Layout] = field(default_factory=dict)
    box: dict[str, Box] = field(default_factory=dict)
    local: dict[str, torch.Tensor] = field(default_factory=dict)
    desc: dict[str, dict[str, Any]] = field(default_factory=dict)


def shard_of(owner: int, sidecar_raw: bytes, sc: Any, header: ShardHeader, where: str) -> Shard:
    old, saved = {}, {}
    for name, node, path in _dnodes(sc.tree, ""):
        st = header.tensors.get(name)
        if st is None:
            raise CorruptCheckpointError(f"{where}: the tree names tensor {name!r} but the shard lacks it")
        old[name] = Layout.of(node, st.dtype, path)
        saved[name] = (tuple(node.get("global_offset", ())), tuple(node.get("local_shape", ())))
        if saved[name][1] != st.shape:
            raise CorruptCheckpointError(f"{where}: {path} records shape {saved[name][1]} but stores {st.shape}")
    return Shard(owner, sidecar_raw, sc.tree, header, old, saved)


def open_served(ctx: Any, step: int, owner: int, old_world: int) -> Shard:
    """An old shard this rank serves, mapped, its identity checked (CorruptCheckpointError:
    a bad copy; CheckpointError: its tree cannot be resharded)."""
    folder = rank_folder(ctx.local_dir, ctx.job, owner)
    reader = ShardReader(folder, step, verify_checksum=False, populate=False)
    try:
        sc = reader.sidecar
        if sc.rank != owner or sc.job != ctx.job or sc.world_size != old_world:
            raise CorruptCheckpointError(
                f"{folder}: step {step} claims rank {sc.rank} of {sc.world_size} of job {sc.job!r}"
            )
        raw = json.dumps(sc.to_json(), separators=(",", ":")).encode()  # the record read once, as parsed
        shard = shard_of(owner, raw, sc, reader.header, reader.path)
        shard.reader = reader
        return shard
    except BaseException:
        reader.close()
        raise


def check_boxes(shard: Shard, old_world: int) -> None:
    """Every DTensor of a served shard lies where the arithmetic all ranks use puts it."""
    owner = shard.owner
    for name, lay in shard.old.items():
        if lay.world != old_world:
            raise CheckpointError(
                f"{name}: saved on a {lay.mesh_shape} mesh of {lay.world} ranks in a job of {old_world}; "
                f"only meshes over every rank can be resharded in place - restart with {old_world} ranks, "
                f"or assemble a full state with `incluster export`"
            )
        want = lay.box(coord_of(owner, lay.mesh_shape))
        if numel(want) and want != shard.saved[name]:
            raise CheckpointError(
                f"{name}: rank {owner} saved box {shard.saved[name]} but its mesh coordinate gives {want}; "
                f"only meshes laid over the ranks in order (init_device_mesh) can be resharded in place"
            )


def live_layout(state: Mapping[str, Any], shard: Shard, rank: int, world: int, allow_pickle: bool) -> Live:
    """The live DTensors the saved ones land in; CheckpointError where they cannot."""
    found = live_dtensors(state, shard.tree, allow_pickle=allow_pickle)
    live = Live()
    for name, node, path in _dnodes(shard.tree, ""):
        if name not in found:
            raise CheckpointError(
                f"{path}: the checkpoint holds a DTensor shard here but the live value is not a DTensor; build "
                f"the model with the same parallelism (any world size) before loading"
            )
        dt = found[name][0]
        desc = dtensor.describe(dt)
        local = dtensor.local_of(dt)
        lay = Layout.of(desc, dtype_name(local.dtype, path), path)
        old = shard.old[name]
        if (lay.dtype, lay.global_shape) != (old.dtype, old.global_shape):
            raise CheckpointError(
                f"{path}: the checkpoint holds a {old.dtype} tensor of global shape {list(old.global_shape)}, the "
                f"live one is {lay.dtype} {list(lay.global_shape)}; build the model with the same configuration"
            )
        box = (tuple(desc["global_offset"]), tuple(desc["local_shape"]))
        if lay.world != world or (numel(box) and box != lay.box(coord_of(rank, lay.mesh_shape))):
            raise CheckpointError(
                f"{path}: the live mesh {lay.mesh_shape} is not laid over all {world} ranks in order "
                f"(init_device_mesh); a resharding restore needs one"
            )
        live.new[name], live.box[name], live.local[name], live.desc[name] = lay, box, local, desc
    return live


def mesh_changed(state: Mapping[str, Any], tree: Any, allow_pickle: bool) -> bool:
    """Whether live DTensors of the saved global shapes are cut unlike the saved shards (a
    different mesh or placements at the same world size): a restore then reshards. Other
    mismatches are left to the load, which names them."""
    try:
        found = live_dtensors(state, tree, allow_pickle=allow_pickle)
    except CheckpointError:
        return False
    for name, node, _ in _dnodes(tree, ""):
        if name not in found:
            continue
        now = dtensor.describe(found[name][0])
        if now["global_shape"] != node.get("global_shape"):
            continue
        if any(now[k] != node.get(k) for k in ("mesh_shape", "placements", "global_offset", "local_shape")):
            return True
    return False


def check_rest(state: Mapping[str, Any], shard: Shard, live: Live, allow_pickle: bool) -> None:
    """Plain tensors are taken whole from the source rank: they must fit the live ones."""
    for name, t in live_targets(state, rewritten(shard.tree, live), allow_pickle=allow_pickle).items():
        st = shard.header.tensors.get(name)
        if st is not None and name not in live.local and (tuple(t.shape) != st.shape or t.dtype != NAME_TO_DTYPE[st.dtype]):
            raise CheckpointError(
                f"{name}: old rank {shard.owner} stored {st.dtype} {list(st.shape)}, the live tensor is "
                f"{dtype_name(t.dtype, name)} {list(t.shape)}; a tensor that differs between world sizes must be "
                f"a DTensor to be resharded"
            )


def byte_span(shard: Shard, name: str, box: Box) -> tuple[int, int]:
    """File bytes [lo, hi) that hold ``box`` of ``name`` in ``shard`` (and some between)."""
    st = shard.header.tensors[name]
    outer = shard.saved[name]
    strides = [1] * len(st.shape)
    for i in range(len(st.shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * st.shape[i + 1]
    sl = local_slices(box, outer)
    first = sum(s.start * k for s, k in zip(sl, strides))
    last = sum((s.stop - 1) * k for s, k in zip(sl, strides))
    es = NAME_TO_DTYPE[st.dtype].itemsize
    return st.offset + first * es, st.offset + (last + 1) * es


def verify_spans(shard: Shard, spans: list[tuple[int, int]], where: str) -> None:
    """Check every checksum chunk the spans touch (each once), on the hashing threads."""
    expected = shard.reader.sidecar.checksum  # type: ignore[union-attr]
    view = memoryview(shard.reader.raw().numpy())  # type: ignore[union-attr,arg-type]
    chunks = sorted({k for lo, hi in spans if hi > lo for k in range(lo // expected.chunk, (hi - 1) // expected.chunk + 1)})
    pool = checksum_pool()
    futures = [(k, pool.submit(digest, view[k * expected.chunk : min(expected.size, (k + 1) * expected.chunk)])) for k in chunks]
    for k, f in futures:
        if f.result() != expected.digests[k]:
            lo = k * expected.chunk
            raise CorruptCheckpointError(f"{where}: checksum mismatch in bytes {lo}..{min(lo + expected.chunk, expected.size)}")


def view_of(shard: Shard, name: str, box: Box | None = None) -> torch.Tensor:
    """``box`` (default: all) of ``name`` in a served shard, a view of the mapped file."""
    st = shard.header.tensors[name]
    t = shard.reader.raw()[st.offset : st.offset + st.nbytes]  # type: ignore[union-attr]
    t = t.view(NAME_TO_DTYPE[st.dtype]).view(st.shape)
    return t if box is None else t[local_slices(box, shard.saved[name])]


def rewritten(tree: Any, live: Live) -> Any:
    """``tree`` with every DTensor node describing the live shard (whose bytes are in place)."""
    if isinstance(tree, dict):
        if "D" in tree:
            return {"D": tree["D"], **live.desc[tree["D"]]}
        return {k: rewritten(v, live) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rewritten(v, live) for v in tree]
    return tree


def _dnodes(node: Any, path: str) -> Any:
    """(name, node, path) of every DTensor node of a tree."""
    if not isinstance(node, dict):
        return
    if "D" in node:
        yield node["D"], node, path
        return
    if "S" in node:
        yield from _dnodes(node.get("v"), path)
    elif "d" in node:
        for k, v in node["d"]:
            yield from _dnodes(v, f"{path}/{k}" if path else str(k))
    elif "l" in node or "t" in node:
        for i, v in enumerate(node.get("l", node.get("t")) or []):
            yield from _dnodes(v, f"{path}/{i}")


def _tensor_names(node: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(node, dict):
        for key in ("T", "P", "D"):
            if key in node:
                out.add(node[key])
        for v in node.values():
            if isinstance(v, (dict, list)):
                out |= _tensor_names(v)
    elif isinstance(node, list):
        for v in node:
            out |= _tensor_names(v)
    return out
