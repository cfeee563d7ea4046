"""Options for the fault suite: ``--campaign N`` runs N seeded trials instead of the small set."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--campaign", type=int, default=0, help="run N seeded crash-campaign trials (default: a small fixed set)")
    parser.addoption("--campaign-seed", type=int, default=1, help="seed of the --campaign trials")
