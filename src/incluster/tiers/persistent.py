"""Tier 2: any path or fsspec URL (local folder, ``file://``, ``s3://``, ``gs://``, ...).

Writes are streamed in chunks straight from the caller's buffer (a mapped slot file), so
no full copy of a shard is ever made in Python. On POSIX paths an object is written to a
temporary name, fsynced, renamed, and its folder fsynced; on object stores a single PUT
(or a completed multipart upload) is already atomic. Filesystems that fsspec can only
reach through an optional package raise :class:`TierUnavailableError` naming the extra.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import re
import stat
import time
from typing import Any

from incluster.errors import CheckpointError, CorruptCheckpointError, TierUnavailableError

CHUNK = 16 * 1024 * 1024
_PARTIAL = re.compile(r"\.tmp-\d+$")  # write()'s name for a file being written
STALE_TMP_S = 600.0  # a half-written file this much older than the owner record was left by a killed process
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# S3: the root's first component is a bucket, and s3fs's makedirs creates a missing one,
# so a mistyped name would quietly take every checkpoint. (gcsfs answers a bucket lookup
# it may not make, IAM without storage.buckets.get, by listing: an empty bucket would look
# missing. Other stores keep fsspec's behaviour.)
_BUCKETED = ("s3", "s3a")


_PAGE = 4096
_DIRECT_MIN = 4 << 20  # smaller writes (sidecars, manifests) go through the page cache


def _page_aligned(view: memoryview) -> bool:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % _PAGE == 0
    except (TypeError, ValueError):  # read-only or not a plain buffer: no O_DIRECT
        return False


_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def check_url(url: str) -> None:
    """Refuse a persistent URL that is mistyped: one slash after the scheme (``s3:/b/x``
    would be a local folder named ``s3:``), or a protocol fsspec does not know."""
    import fsspec

    if m := _ONE_SLASH.match(url):
        raise CheckpointError(
            f"persistent tier {url!r}: {m.group(1)}:/ has one slash, so it would be a local folder named "
            f"'{m.group(1)}:'; write {m.group(1)}://{url[m.end():]}"
        )
    if "://" in url:
        scheme = url.split("://", 1)[0]
        known = set(fsspec.available_protocols())
        if scheme not in known:
            hint = f"write {scheme.lower()}://" if scheme.lower() in known else "use a path, or a URL such as s3://bucket/prefix"
            raise CheckpointError(f"persistent tier {url!r}: fsspec knows no protocol {scheme!r}; {hint}")


def open_tier(spec: Any, options: dict[str, Any] | None = None) -> Any:
    """The tier for ``persistent=``: a :class:`~incluster.tiers.base.Tier` object as given
    (e.g. a test's ``FaultyTier``), or an :class:`FsspecTier` over a path or URL."""
    from incluster.tiers.base import Tier

    if isinstance(spec, Tier):
        return spec
    return FsspecTier(str(spec), options)


class _BackendErrors:
    """Errors of a storage backend's own kinds become OSError: botocore's, for one,
    reports a refused or timed-out connection as neither an OSError nor a
    ConnectionError, and every caller here (upload retries, restore planning, the tools)
    handles a tier's failures as OSError."""

    def __init__(self, tier: "FsspecTier", what: str) -> None:
        self.tier, self.what = tier, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:  # never swallows an error
        if exc is None or isinstance(exc, (OSError, TierUnavailableError)) or not isinstance(exc, Exception):
            return
        raise OSError(f"{self.tier.url}: {self.what} failed: {type(exc).__name__}: {exc}") from exc


class FsspecTier:
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        import fsspec

        check_url(url)
        self.url = url
        opts = dict(options or {})
        # Not an fsspec option: caps this tier's throughput (bytes/s), e.g. to rehearse a
        # restore from cloud storage at its real bandwidth.
        self.max_bytes_per_s = float(opts.pop("max_bytes_per_s", 0) or 0)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **opts)
        except ImportError as exc:
            scheme = url.split("://", 1)[0]
            extra = _EXTRAS.get(scheme, scheme)
            raise TierUnavailableError(
                f"the persistent tier {url!r} needs an optional package ({exc}); "
                f"install it with: pip install 'incluster[{extra}]'"
            ) from None
        self.root = root.rstrip("/")
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.posix = protocol in ("file", "local")
        # A filesystem held in the memory of the process that uses it: the writer process
        # would upload into its own, which goes when it does
        self.process_local = protocol == "memory"

        self.bucket = self.root.split("/", 1)[0] if protocol in _BUCKETED else None
        self._bucket_seen = False

    def check_writable(self) -> None:
        """A local (or mounted) path: its folder exists or can be made, and this process
        may write there; else TierUnavailableError naming it, at start-up rather than at
        the first upload. (Object stores are checked at their first use: a network call.)"""
        if not self.posix:
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable by this process")
        except OSError as exc:
            raise TierUnavailableError(
                f"the persistent tier {self.url!r} cannot be written ({exc.strerror or exc}); fix persistent= "
                f"(a folder this process may create and write), or leave it out") from None

    def _check_bucket(self) -> None:
        """A bucket that does not exist is an error naming it: never created, never
        listed as an empty tier (a restart would start afresh beside the real one)."""
        if self.bucket is None or self._bucket_seen:
            return
        try:
            with _BackendErrors(self, f"looking up the bucket {self.bucket}"):
                self.fs.info(self.bucket)  # an unreachable store raises its own error, not this one
        except FileNotFoundError:
            raise TierUnavailableError(
                f"the bucket {self.bucket!r} of the persistent tier {self.url!r} does not exist, or these "
                f"credentials cannot see it. incluster never creates buckets: create it, or fix persistent= "
                f"(and persistent_options / the AWS settings for its endpoint and credentials)"
            ) from None
        except PermissionError:
            pass  # refused a look at the bucket (it exists): the operation itself says what it may do
        self._bucket_seen = True

    def _pace(self, started: float, done: int) -> None:
        if self.max_bytes_per_s > 0:
            ahead = done / self.max_bytes_per_s - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)

    def _p(self, path: str) -> str:
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"tier paths must not contain '.' or '..' ({path!r})")
        return posixpath.join(self.root, *parts)

    def write(self, path: str, data: memoryview, *, atomic: bool = True) -> None:
        full = self._p(path)
        if self.posix:
            _private_dirs(posixpath.dirname(full))
        elif self.bucket is not None:
            self._check_bucket()  # and no makedirs: S3 has no folders, and s3fs's would create the bucket
        else:
            with _BackendErrors(self, f"creating the folder of {path}"):
                self.fs.makedirs(posixpath.dirname(full), exist_ok=True)
        view = memoryview(data).cast("B")
        t0 = time.monotonic()
        if not self.posix:
            with _BackendErrors(self, f"writing {path}"), self.fs.open(full, "wb") as f:
                for i in range(0, view.nbytes, CHUNK):
                    f.write(view[i : i + CHUNK])
                    self._pace(t0, i + CHUNK)
            return
        tmp = f"{full}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fd = self._write_all(fd, tmp, view, t0)
            if atomic:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, full)
        if atomic:
            dfd = os.open(posixpath.dirname(full), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _write_all(self, fd: int, tmp: str, view: memoryview, t0: float) -> int:
        """Write ``view`` into the new file ``tmp`` (open as ``fd``); returns the fd to
        close. A large, page-aligned buffer (a mapped slot) goes with O_DIRECT, bypassing
        the page cache: a new file then costs no fresh page-cache pages (1 GiB of them
        took ~2.6 s to touch on the machine this was measured on; 528 MiB were written in
        0.17 s direct against 1.5 s buffered) and evicts nothing. The unaligned tail, and
        anything O_DIRECT refuses, is written through the page cache."""
        done, direct = 0, 0
        if view.nbytes >= _DIRECT_MIN and _page_aligned(view) and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(tmp, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # e.g. a filesystem without O_DIRECT
                dfd = -1
            if dfd >= 0:
                direct = view.nbytes - view.nbytes % _PAGE
                try:
                    while done < direct:
                        done += os.write(dfd, view[done : min(direct, done + CHUNK)])
                        self._pace(t0, done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        os.close(dfd)
                        raise
                    done = 0  # refused after all: write it all through the page cache
                os.close(dfd)
        while done < view.nbytes:  # os.write may write less than asked
            done += os.pwrite(fd, view[done : done + CHUNK], done)
            self._pace(t0, done)
        return fd

    def read(self, path: str, into: memoryview | None = None) -> bytes | int:
        full = self._p(path)
        t0 = time.monotonic()
        if self.posix:  # a named pipe there would block the read for ever: refused, as corrupt
            try:
                mode = os.stat(full).st_mode
            except OSError:
                mode = stat.S_IFREG  # missing: fsspec says so in its words below
            if not stat.S_ISREG(mode):
                raise CorruptCheckpointError(f"{full}: not a regular file (a named pipe or a folder)")
        self._fresh(full)
        with _BackendErrors(self, f"reading {path}"), self.fs.open(full, "rb") as f:
            if into is None:
                data: bytes = f.read()
                self._pace(t0, len(data))
                return data
            view = memoryview(into).cast("B")
            n = 0
            while n < view.nbytes:
                chunk = f.read(min(CHUNK, view.nbytes - n))
                if not chunk:
                    break
                view[n : n + len(chunk)] = chunk
                n += len(chunk)
                self._pace(t0, n)
            return n

    def size(self, path: str) -> int:
        self._fresh(self._p(path))
        with _BackendErrors(self, f"the size of {path}"):
            return int(self.fs.info(self._p(path))["size"])

    def delete(self, path: str) -> None:
        full = self._p(path)
        try:
            with _BackendErrors(self, f"deleting {path}"):
                self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass

    def list(self, prefix: str = "") -> list[str]:
        full = self._p(prefix) if prefix else self.root
        self._fresh(full)
        try:
            with _BackendErrors(self, f"listing {prefix or '/'}"):
                entries = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            self._check_bucket()
            return []
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    def sweep_partial(self, prefix: str, than: str, age_s: float = STALE_TMP_S) -> int:
        """Remove the half-written files (``*.tmp-PID``) directly under ``prefix`` older
        than the file ``than`` by ``age_s``: left by a process killed while it wrote (a
        live write takes far less). Both times are the file server's (a shared tier's
        clock need not be this host's). Only a path tier has them (an object store writes
        whole objects). Returns how many went."""
        if not self.posix:
            return 0
        try:
            now = os.stat(self._p(than)).st_mtime
        except FileNotFoundError:
            return 0
        gone = 0
        for name in self.list(prefix):
            if not _PARTIAL.search(name):
                continue
            full = posixpath.join(self._p(prefix), name)
            try:
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > age_s:
                    os.unlink(full)
                    gone += 1
            except OSError:  # swept by another run first, or not this process's to remove
                pass
        return gone

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """The files directly under ``prefix`` and their sizes (one listing)."""
        self._fresh(self._p(prefix))
        try:
            with _BackendErrors(self, f"listing {prefix}"):
                entries = self.fs.ls(self._p(prefix), detail=True)
        except FileNotFoundError:
            self._check_bucket()
            return {}
        return {posixpath.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0) for e in entries}

    def _fresh(self, full: str) -> None:
        """Forget what the client cached of ``full`` (and the folders above it): other
        processes write the tier (every rank's writer, a later run), and an object store's
        client (s3fs) answers listings, sizes and reads from its cached listing of the
        folder - a file another process rewrote read as gone or empty, a new one was not
        listed. Each call then asks the store."""
        if not self.posix:
            try:
                self.fs.invalidate_cache(full)
            except Exception:  # noqa: BLE001 - a backend without a cache to forget
                pass

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"FsspecTier({self.url!r})"


def _private_dirs(path: str) -> None:
    """mkdir -p where every folder created is 0700 (os.makedirs sets only the last one)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass
