"""The byte-tier interface: five methods, so a new tier costs under a hundred lines."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tier(Protocol):
    """A place that stores named byte objects (paths relative to the tier's root)."""

    def write(self, path: str, data: memoryview, *, atomic: bool = True) -> None:
        """Store ``data`` at ``path``, streamed; readers never see a partial object."""
        ...

    def read(self, path: str, into: memoryview | None = None) -> bytes | int:
        """The whole object (bytes), or read it into ``into`` and return the byte count."""
        ...

    def delete(self, path: str) -> None:
        """Remove an object or a folder of objects; missing is not an error."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Names directly under ``prefix`` (files and folders), sorted."""
        ...

    def close(self) -> None: ...
