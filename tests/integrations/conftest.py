"""Integration tests train with the real frameworks (the ``integrations`` extra).

``require(dist)`` skips a test only when the framework is not installed at all; once it
is installed, any import error fails the test, so a broken integration never hides.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import pytest


def require(dist: str, module: str) -> ModuleType:
    """Import ``module`` from distribution ``dist``; skip only if ``dist`` is absent."""
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (pip install -e '.[integrations]')")
    return importlib.import_module(module)
