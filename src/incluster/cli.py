"""The ``incluster`` command line: one sub-command per concern, each in its own module."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="incluster",
        description="In-cluster, multi-tier, asynchronous checkpointing for PyTorch.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from incluster.demo import cluster, showcase

    cluster.register(sub)
    showcase.register(sub)

    from incluster import tools

    tools.register(sub)

    from incluster.goodput import cli as goodput_cli

    goodput_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from incluster import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
