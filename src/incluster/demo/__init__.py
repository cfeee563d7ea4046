"""Demonstrations run by ``incluster demo``."""

import argparse
from typing import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (a bad value is a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the least value, {low}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse
