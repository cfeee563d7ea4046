"""The command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def test_showcase_runs_and_reports_a_bitwise_restore(local_dir):
    out = subprocess.run(
        [sys.executable, "-m", "incluster", "showcase", "--mib", "8", "--steps", "5", "--every", "2", "--local-dir", local_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "restored step 4 (last saved 4)" in out.stdout
    assert "bitwise equal: yes" in out.stdout.replace("\n", " ")


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "incluster", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip()
    out = subprocess.run([sys.executable, "-m", "incluster"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "demo" in out.stdout
