"""Tier 0, the node's RAM disk: where shards live, how they are listed and read back.

Layout: ``<local_dir>/<job>/rank-RRRRR/step-SSSSSSSSSSSS.{safetensors,json}``; folders
0700, files 0600. A step exists iff its sidecar exists (the commit marker); reading one
validates the sidecar, the header and every checksum before any byte is handed out.
"""

from __future__ import annotations

import mmap
import os
import warnings
import re
from typing import Any

import torch

from incluster.errors import CorruptCheckpointError
from incluster.format.checksum import verify
from incluster.format.dtypes import NAME_TO_DTYPE
from incluster.format.reader import ShardHeader, header_length, parse_header
from incluster.format.sidecar import Sidecar, open_regular, read_sidecar
from incluster.staging.slots import sidecar_file, step_file

_SIDECAR = re.compile(r"^step-(\d{12,})\.json$")
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_job(job: str) -> str:
    if not isinstance(job, str) or not _JOB.match(job):
        raise ValueError(
            f"job {job!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit (it names a folder)"
        )
    return job


def rank_folder(local_dir: str, job: str, rank: int) -> str:
    return os.path.join(local_dir, check_job(job), f"rank-{rank:05d}")


def data_path(folder: str, sidecar: Sidecar) -> str:
    """Where a committed copy's bytes are: its own folder, or for a shared replica (a
    data-parallel peer on this node saved the very same bytes, see
    :mod:`incluster.replication`) that peer's shard file of the same step. Derived here from
    the peer's rank number, never from a path in the record."""
    peer = sidecar.extra.get("shared_with")
    if type(peer) is int and peer >= 0:
        return os.path.join(os.path.dirname(os.path.abspath(folder)), f"rank-{peer:05d}", step_file(sidecar.step))
    return os.path.join(folder, sidecar.shard)


def committed_steps(folder: str) -> list[int]:
    """Steps with a sidecar in ``folder``, newest first (not yet verified)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := _SIDECAR.match(n))), reverse=True)


def open_shard(folder: str, step: int) -> tuple[int, Sidecar, ShardHeader, str]:
    """A committed shard opened for reading: (fd, sidecar, validated header, path).

    Nothing past the header is read and nothing is mapped; the caller reads the data with
    ``os.preadv`` and MUST check every byte against ``sidecar.checksum`` as it goes (see
    :class:`incluster.format.checksum.ChunkVerifier`). The caller closes the fd."""
    sidecar = read_sidecar(os.path.join(folder, sidecar_file(step)))
    if sidecar.step != step:
        raise CorruptCheckpointError(f"{folder}: sidecar of step {step} says step {sidecar.step}")
    path = data_path(folder, sidecar)
    fd = open_regular(path, "shard")
    try:
        size = os.fstat(fd).st_size
        if size != sidecar.checksum.size:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes on disk but the sidecar says {sidecar.checksum.size} (truncated or overwritten)"
            )
        prefix = os.pread(fd, 8, 0)
        n = header_length(prefix, size, path)
        header = parse_header(prefix + os.pread(fd, n, 8), size, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, sidecar, header, path


class ShardReader:
    """A committed shard, verified, mapped read-only; ``tensor(name)`` views into it.

    WARNING: the views are read-only memory: copy from them, never into them."""

    def __init__(self, folder: str, step: int, *, verify_checksum: bool = True, populate: bool = True) -> None:
        self.sidecar: Sidecar = read_sidecar(os.path.join(folder, sidecar_file(step)))
        if self.sidecar.step != step:
            raise CorruptCheckpointError(f"{folder}: sidecar of step {step} says step {self.sidecar.step}")
        self.path = data_path(folder, self.sidecar)
        self._mm: mmap.mmap | None = None
        self._buf: torch.Tensor | None = None
        fd = open_regular(self.path, "shard")
        try:
            size = os.fstat(fd).st_size
            if size != self.sidecar.checksum.size:
                raise CorruptCheckpointError(
                    f"{self.path}: {size} bytes on disk but the sidecar says {self.sidecar.checksum.size} "
                    f"(truncated or overwritten)"
                )
            if size < 8:
                raise CorruptCheckpointError(f"{self.path}: {size} bytes is too short to be a shard")
            # Read-only and populated in one pass (not one fault per page). Never written:
            # a private writable mapping would copy every page when populated.
            # (populate=False: pages are mapped as they are first read, a few at a time.)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            if verify_checksum:
                verify(self._mm, self.sidecar.checksum, self.path)
            n = header_length(self._mm[:8], size, self.path)
            self.header: ShardHeader = parse_header(self._mm[: 8 + n], size, self.path)
        except BaseException:
            self.close()
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": by design
            self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)

    @classmethod
    def over(cls, path: str, sidecar: Sidecar, buf: torch.Tensor) -> "ShardReader":
        """A reader over bytes already mapped and verified (a slot just received)."""
        self = cls.__new__(cls)
        self.sidecar, self.path, self._mm = sidecar, path, None
        size = int(buf.numel())
        raw = bytes(buf[:8].numpy())
        n = header_length(raw, size, path)
        self.header = parse_header(bytes(buf[: 8 + n].numpy()), size, path)
        self._buf = buf
        return self

    @property
    def nbytes(self) -> int:
        return self.header.file_size

    def raw(self) -> torch.Tensor:
        """The whole file as one uint8 tensor (for sending it as is)."""
        if self._buf is None:
            raise CorruptCheckpointError(f"{self.path}: reader is closed")
        return self._buf

    def tensor(self, name: str) -> torch.Tensor:
        t = self.header.tensors.get(name)
        if t is None or self._buf is None:
            raise CorruptCheckpointError(f"{self.path}: the state tree names tensor {name!r} but the shard lacks it")
        return self._buf[t.offset : t.offset + t.nbytes].view(NAME_TO_DTYPE[t.dtype]).view(t.shape)

    def close(self) -> None:
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with it
            self._mm = None

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
