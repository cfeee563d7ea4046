"""Where the log format shows the logger's name, "incluster" is said once per message;
where it does not (or logging is not configured), the message still says where it is from."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

import incluster  # noqa: F401 - installs the filter, as any use of the package does


@pytest.fixture
def incluster_log():
    log = logging.getLogger("incluster")
    saved = (log.handlers[:], log.propagate, log.level)
    log.handlers, log.propagate = [], False
    log.setLevel(logging.INFO)
    try:
        yield log
    finally:
        log.handlers, log.propagate = saved[0], saved[1]
        log.setLevel(saved[2])


def _printed(log: logging.Logger, *formats: str, style: str = "%") -> list[str]:
    streams = []
    for fmt in formats:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(fmt, style=style))  # type: ignore[arg-type]
        log.addHandler(handler)
        streams.append(stream)
    log.warning("incluster: rank %d: the RAM disk is full", 3)
    for h in log.handlers[:]:
        log.removeHandler(h)
    return [s.getvalue().strip() for s in streams]


def test_a_format_showing_the_name_says_incluster_once(incluster_log):
    assert _printed(incluster_log, "%(name)s - %(levelname)s - %(message)s") == [
        "incluster - WARNING - rank 3: the RAM disk is full"]
    assert _printed(incluster_log, "[{name}] {message}", style="{") == ["[incluster] rank 3: the RAM disk is full"]


def test_a_bare_format_keeps_the_word(incluster_log):
    assert _printed(incluster_log, "%(message)s") == ["incluster: rank 3: the RAM disk is full"]
    # one handler without the name: both print the word (the record is shared)
    assert _printed(incluster_log, "%(name)s %(message)s", "%(message)s") == [
        "incluster incluster: rank 3: the RAM disk is full", "incluster: rank 3: the RAM disk is full"]


def test_unconfigured_logging_prints_the_word():
    # no handler anywhere: Python's last-resort handler prints the bare message to stderr
    code = ("import logging, incluster; "
            "logging.getLogger('incluster').warning('incluster: rank %d: the RAM disk is full', 3)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stderr.strip() == "incluster: rank 3: the RAM disk is full"
