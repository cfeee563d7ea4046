"""Shared fixtures: every test gets its own RAM-disk folder, removed even on failure."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterator

import pytest
import torch


def _ram_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def local_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="incluster-test-", dir=_ram_root())
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for the whole session (installed by `make test`)."""
    import s3server

    yield from s3server.server()
