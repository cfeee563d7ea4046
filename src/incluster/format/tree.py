"""Validation of the state tree a sidecar carries, before anything walks it.

The tree comes from a file (or a peer), so it is checked like the shard header: every
node is one of the kinds ``docs/format.md`` lists, with fields of the right types, and
the nesting and node count are bounded, so a hostile record can neither exhaust the
loader's stack nor reach it as a shape it does not expect. Iterative, no recursion.
"""

from __future__ import annotations

from typing import Any

from incluster.errors import CorruptCheckpointError

MAX_DEPTH = 200
MAX_NODES = 10_000_000
_SCALAR = (str, int, float, bool, type(None))
_FLOATS = ("nan", "inf", "-inf")


def check_tree(tree: Any, where: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``tree`` is a well-formed state tree."""
    if not isinstance(tree, dict) or not isinstance(tree.get("d"), list):
        raise CorruptCheckpointError(f"{where}: the state tree must be a dict node at its top")
    stack: list[tuple[Any, int]] = [(tree, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if depth > MAX_DEPTH or seen > MAX_NODES:
            raise CorruptCheckpointError(
                f"{where}: the state tree is nested deeper than {MAX_DEPTH} levels or has more than "
                f"{MAX_NODES} nodes; it was not written by incluster"
            )
        for child in _children(node, where):
            stack.append((child, depth + 1))


def _children(node: Any, where: str) -> list[Any]:
    bad = CorruptCheckpointError(f"{where}: malformed state tree node {str(node)[:120]!r}")
    if not isinstance(node, dict) or not node:
        raise bad
    if "S" in node:
        if not isinstance(node["S"], str) or set(node) != {"S", "v"}:
            raise bad
        return [node["v"]]
    for tag in ("T", "P"):
        if tag in node:
            if len(node) != 1 or not isinstance(node[tag], str):
                raise bad
            return []
    if "D" in node:
        if not isinstance(node["D"], str):
            raise bad
        return []
    if len(node) != 1:
        raise bad
    if "d" in node:
        items = node["d"]
        if not isinstance(items, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], _SCALAR) for p in items
        ):
            raise bad
        return [p[1] for p in items]
    for tag in ("l", "t"):
        if tag in node:
            if not isinstance(node[tag], list):
                raise bad
            return list(node[tag])
    if "v" in node:
        if not isinstance(node["v"], _SCALAR):
            raise bad
        return []
    if "f" in node:
        v = node["f"]
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) or v in _FLOATS):
            raise bad
        return []
    raise bad
