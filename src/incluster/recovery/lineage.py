"""Which timeline each copy belongs to, and which copies a restore may combine.

Every save records its lineage in its sidecar (and the persistent tier's manifest):
``(began, loads, base)``. ``began`` is rank 0's clock (ns) when the run's Checkpointer
started, ``loads`` how many ``load()`` calls it had made before the save, ``base`` the
step the last of them restored (-1: none). ``(began, loads)`` is the timeline: every
rank's saves between two loads share it, without any collective. Copies written by an
older incluster have no lineage: ``(0, 0, -1)``.

A step number can be saved by two timelines: a ``load()`` that went back past step N (its
copies lost, or found bad) saves N again, while a node that was away during that restore
still holds the old N. A restore that combined the two would load a torn state, each
shard intact. So, before any planning:

1. a timeline that restored ``base`` abandoned every newer step of the timelines before
   it: a copy of step ``s`` is dropped when a later timeline with ``base < s`` (and at
   least one load) has any copy in the job;
2. of what is left, at each step only the latest timeline's copies count.

"Later" is the order of ``(began, loads)``: the later run, and within a run the later
load. (Rank 0's clocks of two runs are compared; a run started on a host whose clock is
behind the previous run's by more than the time between the runs would be taken as the
older one. That can only choose which whole timeline is restored, never mix two.)
"""

from __future__ import annotations

import bisect
from typing import Iterable, Mapping

NONE = (0, 0, -1)  # a copy without a recorded lineage

Lineage = tuple[int, int, int]  # (began ns, loads, base step)


def parse(value: object) -> Lineage:
    """A sidecar's or manifest's ``lineage`` field; NONE when absent or malformed."""
    if isinstance(value, (list, tuple)) and len(value) == 3 and all(type(v) is int for v in value):
        began, loads, base = value
        if began >= 0 and loads >= 0 and base >= -1:
            return began, loads, base
    return NONE


def of_item(item: tuple[int, ...]) -> Lineage:
    """The lineage of a restore inventory item ``(owner, step, size, world, content,
    began, loads, base)``; NONE for shorter items."""
    return (item[5], item[6], item[7]) if len(item) >= 8 else NONE


class Timelines:
    """The timelines evidenced by a set of copies, and which copies they abandon."""

    def __init__(self, lineages: Iterable[Lineage]) -> None:
        bases: dict[tuple[int, int], int] = {}
        for began, loads, base in lineages:
            if loads >= 1:  # a timeline that began with a restore: it went on from ``base``
                key = (began, loads)
                bases[key] = min(base, bases.get(key, base))
        self._keys = sorted(bases)
        # _low[i]: the lowest base of keys[i:], the timelines from the i-th on
        self._low = [0] * len(self._keys)
        low = 2**62
        for i in range(len(self._keys) - 1, -1, -1):
            low = min(low, bases[self._keys[i]])
            self._low[i] = low

    def abandoned(self, step: int, lineage: Lineage) -> bool:
        """Whether a later timeline went on from a step older than ``step``."""
        i = bisect.bisect_right(self._keys, (lineage[0], lineage[1]))  # the first later timeline
        return i < len(self._keys) and step > self._low[i]


def latest_of(seen: Iterable[tuple[int, Lineage]]) -> dict[int, Lineage]:
    """Of (step, lineage) pairs - one per copy - the lineage each step's usable copies
    have (rules 1 and 2 above); a step whose every copy is abandoned is absent."""
    seen = list(seen)
    timelines = Timelines(lin for _, lin in seen)
    latest: dict[int, Lineage] = {}
    for step, lin in seen:
        if not timelines.abandoned(step, lin) and (step not in latest or lin > latest[step]):
            latest[step] = lin
    return latest


def current(
    holdings: Mapping[str, Iterable[tuple[int, ...]]], others: Iterable[tuple[int, Lineage]] = (),
) -> tuple[dict[str, list[tuple[int, ...]]], list[tuple[str, int, int]], dict[int, Lineage]]:
    """``holdings`` without the copies a restore must not use (rules 1 and 2 above); the
    dropped ones as (node, owner, step); and the lineage each step's copies must have
    (``others``: (step, lineage) of copies elsewhere - the persistent tier's manifests -
    that count as evidence too; a tier step whose lineage is not the step's is unusable)."""
    items = {node: list(its) for node, its in holdings.items()}
    latest = latest_of([(i[1], of_item(i)) for its in items.values() for i in its] + list(others))
    kept: dict[str, list[tuple[int, ...]]] = {}
    dropped: list[tuple[str, int, int]] = []
    for node, its in items.items():
        kept[node] = []
        for i in its:
            if latest.get(i[1]) == of_item(i):
                kept[node].append(i)
            else:
                dropped.append((node, i[0], i[1]))
    return kept, dropped, latest
