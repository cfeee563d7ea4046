"""The sidecar commit record ``step-N.json``: a shard exists iff its sidecar exists.

Written last, atomically (temporary name, fsync, rename), after the shard's checksum is
computed. Holds everything that is not tensor bytes: identity (job, step, rank, world,
node), the shard's size and chunk checksums, the state tree with its JSON leaves and
DTensor placements, the structure fingerprint and the creation time.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time

import xxhash
from dataclasses import dataclass, field
from typing import Any

from incluster.errors import CheckpointError, CorruptCheckpointError
from incluster.format.checksum import Checksum, content_id
from incluster.format.tree import check_tree

SIDECAR_FORMAT = "incluster-sidecar"
SIDECAR_VERSION = 2  # 2: the record carries a digest of itself ("digest"); 1 is still read
MAX_SIDECAR_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Sidecar:
    job: str
    step: int
    rank: int
    world_size: int
    node: str
    shard: str  # file name of the shard, relative to the sidecar's folder
    checksum: Checksum
    fingerprint: str
    tree: Any
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    # (began, loads, base): the timeline that saved it (incluster.recovery.lineage)
    lineage: tuple[int, int, int] = (0, 0, -1)

    def to_json(self) -> dict[str, Any]:
        body = self._body()
        body["digest"] = record_digest(body)
        return body

    def _body(self) -> dict[str, Any]:
        return {
            "format": SIDECAR_FORMAT,
            "version": SIDECAR_VERSION,
            "job": self.job,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "content": content_id(self.checksum),  # derived: lets a restore find identical shards from the head
            "lineage": list(self.lineage),  # in the head too: a restore reads only the first bytes
            "node": self.node,
            "shard": self.shard,
            "checksum": self.checksum.to_json(),
            "fingerprint": self.fingerprint,
            "tree": self.tree,
            "created": self.created,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "Sidecar":
        if not isinstance(obj, dict) or obj.get("format") != SIDECAR_FORMAT:
            raise CorruptCheckpointError(f"{where}: not an incluster sidecar")
        if obj.get("version") not in (1, SIDECAR_VERSION):
            raise CorruptCheckpointError(
                f"{where}: sidecar version {obj.get('version')!r} is not supported by this incluster "
                f"(expects {SIDECAR_VERSION}); upgrade incluster"
            )
        try:
            sc = cls(
                job=obj["job"],
                step=obj["step"],
                rank=obj["rank"],
                world_size=obj["world_size"],
                node=obj["node"],
                shard=obj["shard"],
                checksum=Checksum.from_json(obj["checksum"], where),
                fingerprint=obj["fingerprint"],
                tree=obj["tree"],
                created=obj["created"],
                extra=obj.get("extra", {}),
                lineage=_lineage(obj.get("lineage", [0, 0, -1]), where),
            )
        except KeyError as exc:
            raise CorruptCheckpointError(f"{where}: sidecar lacks field {exc}") from None
        ints = (sc.step, sc.rank, sc.world_size)
        if not all(type(v) is int and v >= 0 for v in ints) or sc.rank >= max(sc.world_size, 1):
            raise CorruptCheckpointError(f"{where}: sidecar has invalid step/rank/world_size {ints}")
        strs = (sc.job, sc.node, sc.shard, sc.fingerprint)
        if not all(isinstance(v, str) for v in strs) or not isinstance(sc.extra, dict):
            raise CorruptCheckpointError(f"{where}: sidecar has fields of the wrong type")
        if os.sep in sc.shard or sc.shard.startswith(".") or (os.altsep and os.altsep in sc.shard):
            raise CorruptCheckpointError(f"{where}: sidecar names a shard outside its folder ({sc.shard!r})")
        check_tree(sc.tree, where)  # bounds the nesting before anything serializes it again
        if obj["version"] >= 2:
            # The record's own checksum (last: the checks above name what is wrong): a
            # flipped byte in a name of the state tree would still parse, and load a state
            # with a wrong key behind valid shard checksums.
            body = {k: v for k, v in obj.items() if k != "digest"}
            try:
                ok = obj.get("digest") == record_digest(body)
            except (TypeError, ValueError, RecursionError):
                ok = False
            if not ok:
                raise CorruptCheckpointError(f"{where}: the sidecar's own digest does not match its contents")
        return sc


def _lineage(value: Any, where: str) -> tuple[int, int, int]:
    ok = isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value)
    if not ok or value[0] < 0 or value[1] < 0 or value[2] < -1:
        raise CorruptCheckpointError(f"{where}: sidecar has an invalid lineage {value!r}")
    return value[0], value[1], value[2]


def record_digest(body: dict[str, Any]) -> str:
    """xxh3-64 (hex) of a record's canonical JSON (sorted keys, compact): the same for the
    record however it was serialized, as long as it parses to the same values."""
    canon = json.dumps(body, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    return format(xxhash.xxh3_64_intdigest(canon), "016x")


def write_sidecar(path: str, sidecar: Sidecar, fsync: bool = False) -> None:
    """Write atomically: a reader sees the whole record or none of it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    data = json.dumps(sidecar.to_json(), separators=(",", ":")).encode()
    if len(data) > MAX_SIDECAR_BYTES:  # a reader would refuse it: never write a record nobody can load
        raise CheckpointError(
            f"step {sidecar.step}: its record of the state outside tensors is {len(data):,} bytes, over the "
            f"{MAX_SIDECAR_BYTES:,} a reader takes; keep large values (long lists, long strings) as tensors")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, f"short write of {path}")
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)  # no half record left behind (e.g. a full RAM disk)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(os.path.dirname(path))


def open_regular(path: str, what: str) -> int:
    """``path`` opened for reading, refused unless it is a regular file: a link is not
    followed, and a named pipe (whose open blocks until a writer comes) or a device is
    opened without blocking, then refused; so is a folder. :class:`CorruptCheckpointError`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot open {what} ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else "not a regular file"
            raise CorruptCheckpointError(f"{path}: the {what} is {kind}, not a file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_sidecar(path: str) -> Sidecar:
    """Read and validate a sidecar; :class:`CorruptCheckpointError` on anything odd."""
    fd = open_regular(path, "sidecar")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_SIDECAR_BYTES:
            raise CorruptCheckpointError(f"{path}: sidecar is {size} bytes, over the {MAX_SIDECAR_BYTES} cap")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: sidecar is not valid JSON ({exc})") from None
    return Sidecar.from_json(obj, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
