"""Operator tools: ``incluster ls``, ``incluster verify`` and ``incluster export``.

They look at what is stored (RAM folders of one or several nodes, replicas, the
persistent tier) without a running job: read-only, except ``export``, which writes only
its output file. :func:`register` adds the three sub-commands to the ``incluster`` CLI;
each sets ``func(args) -> int`` (0: all good; 1: a fault was found; 2: bad arguments).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

__all__ = ["register"]


_DIRS = ("a node's RAM folder (e.g. /dev/shm/incluster), a job folder, a folder of node folders, "
         "or a persistent-tier path/URL; several DIRs are read together (one per node)")


def _locations(p: argparse.ArgumentParser, *, optional: bool = False) -> None:
    if optional:
        p.add_argument("dirs", metavar="DIR", nargs="*",
                       help=_DIRS + "; none: this node's RAM folder ($INCLUSTER_LOCAL_DIR, else /dev/shm/incluster)")
    else:  # at least one DIR or --persistent URL (checked by the command)
        p.add_argument("dirs", metavar="DIR", nargs="*", help=_DIRS + "; none needed with --persistent")
    p.add_argument("--persistent", metavar="URL", action="append", default=[],
                   help="also read this persistent tier (path or fsspec URL: s3://bucket/ckpt, ...)")
    p.add_argument("--job", default=None, help="only this job (default: every job found)")


def _intermixed(p: argparse.ArgumentParser) -> None:
    """Let ``p`` take options between its positionals (``export DIR... --step N --to F OUT``).

    Plain argparse assigns every positional at the first run of them (``DIR``), leaving
    ``OUT`` unrecognized. The sub-parsers action calls ``p.parse_known_args``, so this
    instance's method is routed through ``parse_known_intermixed_args`` (which calls the
    plain method itself, hence the swap while it runs).
    """
    plain = p.parse_known_args

    def parse(args: Any = None, namespace: Any = None) -> Any:
        p.parse_known_args = plain  # type: ignore[method-assign]
        try:
            return p.parse_known_intermixed_args(args, namespace)
        finally:
            p.parse_known_args = parse  # type: ignore[method-assign]

    p.parse_known_args = parse  # type: ignore[method-assign]


def _here_by_default(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """No DIR and no --persistent: this node's RAM folder, where a job on it saves by default."""

    def with_dirs(args: argparse.Namespace) -> int:
        if not args.dirs and not args.persistent:
            from incluster.config import default_local_dir

            args.dirs = [default_local_dir()]
            if not os.path.exists(args.dirs[0]):
                args.default_missing = args.dirs[0]  # tools.ui.load says so, not "name a RAM folder"
        return run(args)

    return with_dirs


def _later(module: str) -> Callable[[argparse.Namespace], int]:
    """``module.run``, imported when the command runs: building the parser stays light
    (the tools read shards with torch; ``incluster goodput`` and ``--help`` need none)."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).run(args))

    return run


def register(sub: Any) -> None:
    """Add ``ls``, ``verify`` and ``export`` to an argparse sub-parsers object."""
    p = sub.add_parser("ls", help="list stored checkpoints: steps, ranks, nodes, tiers, sizes, completeness")
    _locations(p, optional=True)
    p.set_defaults(func=_here_by_default(_later("incluster.tools.ls")))

    p = sub.add_parser("verify", help="check every stored copy's checksums; non-zero exit on any fault")
    _locations(p, optional=True)
    p.add_argument("--step", type=int, default=None, help="only this step (default: every step)")
    p.set_defaults(func=_here_by_default(_later("incluster.tools.verify")))

    p = sub.add_parser("export", help="assemble one full state dict from every rank's shard of a step")
    _locations(p)
    p.add_argument("--step", type=int, required=True, help="the step to export")
    p.add_argument("--to", choices=("safetensors", "torch", "dcp"), required=True,
                   help="safetensors (tensors; other values in OUT.json) or torch (one torch.save dict), both "
                        "keyed by flat paths ('model/0.weight', 'optim/state/0/exp_avg'), or dcp (a "
                        "torch.distributed.checkpoint folder of the nested state: dcp.load reshards it to any "
                        "world size)")
    p.add_argument("out", metavar="OUT", help="the file to write (for dcp, a new folder)")
    _intermixed(p)
    p.set_defaults(func=_later("incluster.tools.export"))
