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
    # after prepare() (slots and the writer process ready) no save is given up
    assert "first durable save (step 0" in out.stdout and "given up" not in out.stdout, out.stdout
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


def test_the_demo_with_two_nodes_swaps_nobody_and_does_not_say_so():
    """`incluster demo --nodes 2` printed "spare C takes its place, C and C swap positions"."""
    import random

    from incluster.demo.cluster import _replace

    said: list[str] = []

    class Con:
        def print(self, text: str) -> None:
            said.append(text)

    assert _replace(Con(), random.Random(1), ["A", "B"], "A", "C", 7) == ["C", "B"]
    assert "swap" not in said[-1] and "spare C takes its place: C B" in said[-1], said
    for seed in range(20):  # with more nodes two survivors swap, never the spare
        layout = _replace(Con(), random.Random(seed), ["A", "B", "D", "E"], "B", "C", 7)
        assert layout[1] == "C" and sorted(layout) == ["A", "C", "D", "E"] and "swap positions" in said[-1]
