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


@pytest.fixture(scope="session", autouse=True)
def _writers_forked_from_a_server() -> Iterator[None]:
    """Writer processes are forked by one process that imported torch once
    (``incluster.testing.writer_server``), not started as fresh interpreters: each is
    still its own process, with its trainer's environment and output, killed by real
    signals. INCLUSTER_TEST_FRESH_WRITERS=1 starts fresh interpreters instead."""
    if os.environ.get("INCLUSTER_TEST_FRESH_WRITERS") == "1":
        yield
        return
    from incluster.testing.writer_server import ENV, WriterServer

    server = WriterServer()
    os.environ[ENV] = server.path
    try:
        yield
    finally:
        os.environ.pop(ENV, None)
        server.close()


@pytest.fixture(scope="session", autouse=True)
def _ranks_forked_from_a_zygote() -> Iterator[None]:
    """Multi-rank tests start their ranks by forking one process that imported torch once
    (``incluster.testing.zygote``): each rank is still its own process, killed by real
    signals; only the second of CPU each fresh ``import torch`` costs is saved.
    INCLUSTER_TEST_FRESH_RANKS=1 starts fresh interpreters instead."""
    if os.environ.get("INCLUSTER_TEST_FRESH_RANKS") == "1":
        yield
        return
    from incluster.testing import launch
    from incluster.testing.zygote import Zygote

    zygote = Zygote()
    launch.use_zygote(zygote)
    try:
        yield
    finally:
        launch.use_zygote(None)
        zygote.close()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for the whole session (installed by `make test`)."""
    import s3server

    yield from s3server.server()
