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


def test_demo_and_showcase_refuse_values_they_cannot_run_with_a_usage_error(capsys):
    import pytest

    from incluster.cli import main

    for argv, says in ((["demo", "--nodes", "0"], "--nodes: 0 is below the least value, 2"),
                       (["demo", "--save-every", "0"], "--save-every: 0 is below the least value, 1"),
                       (["showcase", "--every", "0"], "--every: 0 is below the least value, 1"),
                       (["showcase", "--steps", "zero"], "--steps: 'zero' is not an integer"),
                       (["showcase", "--mib", "-5"], "--mib: -5 is below the least value, 1")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2 and says in capsys.readouterr().err, argv
    assert main(["demo", "--steps", "8", "--save-every", "5"]) == 2  # a node is lost only after two saves
    assert "--steps must be at least 2 x --save-every + 3 (13)" in " ".join(capsys.readouterr().out.split())
