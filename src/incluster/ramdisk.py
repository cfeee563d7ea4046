"""What the RAM disk under ``local_dir`` is, and whether it hands out huge pages.

A tmpfs mounted without huge pages (the default for /dev/shm) serves every file 4 KiB at
a time: each new slot costs one page fault per 4 KiB, and each restore one page-cache
lookup per 4 KiB. Measured on a 2-core machine (``bench/recovery.py``), a tmpfs mounted
with ``huge=within_size`` made a new 1 GiB slot ~10x cheaper to allocate and a local
restore ~1.3x faster. Only a tmpfs can do this here: hugetlbfs files cannot be read or
written with plain syscalls, which the writer and the restore use.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("incluster")
_HUGE = ("always", "within_size")
_hinted: set[str] = set()


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: tuple[str, ...]

    def option(self, key: str) -> str | None:
        for opt in self.options:
            k, _, v = opt.partition("=")
            if k == key:
                return v
        return None


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in octal (\\040 ...)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path: str, mounts: str | None = None) -> Mount | None:
    """The mount ``path`` lives on (the longest mount point that contains it), from
    ``mounts`` (the text of /proc/mounts; read when None). None if it cannot be told."""
    if mounts is None:
        try:
            with open("/proc/mounts") as f:
                mounts = f.read()
        except OSError:
            return None
    path = os.path.realpath(path)
    best: Mount | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point = _unescape(parts[1])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):  # later mounts shadow earlier ones
            best = Mount(point, parts[2], tuple(parts[3].split(",")))
    return best


def huge_page_hint(path: str, mounts: str | None = None) -> str | None:
    """A one-line hint when ``path`` is on a tmpfs without huge pages; None otherwise (huge
    pages on, not a tmpfs, or unknown)."""
    m = mount_of(path, mounts)
    if m is None or m.fstype != "tmpfs":
        return None
    huge = m.option("huge") or "never"
    if huge in _HUGE:
        return None
    return (
        f"the RAM disk {m.point} (holding {path}) is a tmpfs without huge pages (huge={huge}): every "
        f"checkpoint file is mapped 4 KiB at a time. A tmpfs mounted with huge pages, e.g. `mount -t tmpfs "
        f"-o huge=within_size,size=<N>g tmpfs /mnt/incluster` and local_dir='/mnt/incluster' (or "
        f"INCLUSTER_LOCAL_DIR), allocates new slots ~10x and restores ~1.3x faster (README: RAM disk)"
    )


_RAM = ("tmpfs", "ramfs")


def not_ram_hint(path: str, mounts: str | None = None) -> str | None:
    """A one-line warning when ``path`` is on a disk, not in RAM; None otherwise (or unknown)."""
    m = mount_of(path, mounts)
    if m is None or m.fstype in _RAM:
        return None
    return (
        f"local_dir {path} is on a {m.fstype} file system ({m.point}), not in the node's RAM: saves and "
        f"restores go at that disk's speed, and its pages compete with the page cache. Tier 0 is meant for a "
        f"RAM disk: local_dir='/dev/shm/incluster' (the default) or a tmpfs of your own"
    )


def hint_once(path: str) -> None:
    """Log :func:`huge_page_hint` at INFO (or :func:`not_ram_hint` at WARNING), once per
    process and path."""
    if path in _hinted:
        return
    _hinted.add(path)
    disk = not_ram_hint(path)
    if disk is not None:
        log.warning("incluster: %s", disk)
        return
    hint = huge_page_hint(path)
    if hint is not None:
        log.info("incluster: %s", hint)
