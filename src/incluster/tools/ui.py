"""What the operator tools share: consoles, byte sizes, loading an inventory, copy checks."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Iterable

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from incluster.errors import CheckpointError
from incluster.tools.models import Copy, Inventory
from incluster.tools.scan import open_copy, scan


PIPED_WIDTH = 1000  # output read by a program: rows never wrapped (tables still fit their content)


def consoles() -> tuple[Console, Console]:
    """(stdout for results, stderr for progress and errors); no syntax highlighting of paths.
    A terminal's width is its own (or COLUMNS); output into a pipe or a file is not cut to
    80 columns, so a script that greps a row finds it whole."""
    wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH
    return Console(highlight=False, width=wide), Console(stderr=True, highlight=False)


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def load(args: argparse.Namespace, err: Console) -> Inventory | None:
    """Scan the DIRs named on the command line; None (after saying why) if that fails."""
    missing = getattr(args, "default_missing", None)
    if missing is not None:
        line(err, "[red]error:[/]", f"no DIR given, and this node's RAM folder {missing} ($INCLUSTER_LOCAL_DIR, else "
                                    f"/dev/shm/incluster) does not exist: no job saved there on this node. Name the "
                                    f"folder a job saved into (its local_dir), or a persistent tier (--persistent URL)")
        return None
    try:
        return scan(args.dirs, args.persistent, args.job)
    except (CheckpointError, OSError) as exc:
        text = str(exc)
        tiers = list(getattr(args, "persistent", None) or [])
        if tiers and isinstance(exc, OSError) and not any(t in text for t in tiers + list(args.dirs)):
            # an object store's own words name neither the URL nor what to check
            text = f"reading the persistent tier {', '.join(tiers)}: {text}"
            if isinstance(exc, PermissionError) and any(t.startswith(("s3://", "s3a://")) for t in tiers):
                text += ("; check the AWS settings these commands read (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                         "AWS_ENDPOINT_URL, ~/.aws/config)")
        line(err, "[red]error:[/]", text)
        return None


def line(con: Console, label: str, text: str) -> None:
    """One message per line, never wrapped or cut (tests and scripts grep for paths)."""
    con.print(label, end=" ")
    con.print(text, markup=False, soft_wrap=True)


def check_copies(copies: Iterable[Copy], err: Console, what: str = "verifying") -> dict[int, str | None]:
    """Verify each copy's checksums with a progress bar: ``id(copy) -> None (good) or the reason``."""
    copies = list(copies)
    results: dict[int, str | None] = {}
    columns: list[Any] = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(f"{what} {len(copies)} copies", total=sum(c.nbytes for c in copies) or 1)
        for c in copies:
            bar.update(task, description=f"{what} {c.job} step {c.step} rank {c.rank} ({c.holder})")
            try:
                open_copy(c).close()
                results[id(c)] = None
            except CheckpointError as exc:
                results[id(c)] = str(exc)
            except OSError as exc:
                results[id(c)] = f"{c.where}: cannot read ({exc})"
            bar.advance(task, c.nbytes)
    return results
