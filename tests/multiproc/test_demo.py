"""`incluster demo`, run as a user runs it: a node dies, a spare takes over (or, without one,
the job goes on with fewer ranks), training goes on."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiproc


def test_demo_recovers_from_peers_bitwise(tmp_path):
    png = tmp_path / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "incluster", "demo", "--nodes", "3", "--steps", "24", "--save-every", "2",
         "--dim", "64", "--layers", "2", "--seed", "3", "--timeline", str(png)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env={**os.environ, "COLUMNS": "250"},
    )
    text = " ".join(out.stdout.split())
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "spare D takes its place" in text
    # from the other nodes' RAM, or from the persistent tier when its newest step is newer
    # (an upload can complete before the same step's replicas do)
    assert "peer RAM" in text or "persistent tier:" in text
    assert "matches the saved one on every rank: yes" in text
    assert "(identical)" in text or "no step is trained twice" in text
    assert "DIFFERENT" not in text and "Same failure, persistent tier only" in text
    assert png.exists() and png.stat().st_size > 1000
    base = text.split("RAM folders under ", 1)[1].split(",", 1)[0].split()[0]
    assert base.startswith("/") and not os.path.exists(base), "the demo must remove its RAM folders"


def test_demo_without_spare_goes_on_with_fewer_ranks_resharded(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "incluster", "demo", "--no-spare", "--nodes", "3", "--steps", "24", "--save-every", "2",
         "--dim", "64", "--layers", "2", "--seed", "3", "--timeline", str(tmp_path / "timeline.png")],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env={**os.environ, "COLUMNS": "250"},
    )
    text = " ".join(out.stdout.split())
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "FSDP2, state sharded" in text and "no hot spare" in text
    assert "the job restarts on the 2 surviving nodes" in text and "no spare: 3 -> 2 ranks on" in text
    # every rank's restore reports source "reshard": from the nodes' RAM, or from the
    # persistent tier when its newest step is newer (an upload can beat the replicas)
    assert re.search(r"(surviving nodes' RAM|persistent tier), resharded: [\d.]+ MB", text), text
    assert "own node's RAM" not in text and "peer RAM" not in text
    assert "the whole restored state (every shard gathered) on 2 ranks is bitwise the one 3 ranks saved: yes" in text
    assert "(identical)" in text or "no step is trained twice" in text
    assert "DIFFERENT" not in text and " NO " not in text
    assert re.search(r"training went on with 2 ranks: rank 0's loss [\d.]+ at step \d+ -> [\d.]+ at step 23 ", text), text
    assert "Same failure, persistent tier only" in text
    base = text.split("RAM folders under ", 1)[1].split(",", 1)[0].split()[0]
    assert base.startswith("/") and not os.path.exists(base), "the demo must remove its RAM folders"
