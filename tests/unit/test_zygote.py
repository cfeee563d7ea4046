"""Ranks forked from the test session's zygote behave as fresh ``python script.py``
processes would: their own argv, environment, working directory, log, exit code, and a
real SIGKILL that shows as -9."""

from __future__ import annotations

import os
import signal
import textwrap
import time

from incluster.testing import launch as launch_mod
from incluster.testing.launch import launch

SCRIPT = textwrap.dedent('''
    import os, sys, time
    import helper_mod  # a module next to the script, found as a fresh interpreter finds it
    print("argv", sys.argv[1:], "rank", os.environ["RANK"], "tag", os.environ.get("TAG"), "cwd", os.getcwd())
    print("main", __name__, helper_mod.VALUE)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(os.environ["RANK"]) + 3)
''')


def test_forked_ranks_run_like_fresh_interpreters(local_dir):
    if os.environ.get("INCLUSTER_TEST_FRESH_RANKS") != "1":
        assert launch_mod._zygote is not None, "the suite forks its ranks (tests/conftest.py)"
    script = os.path.join(local_dir, "rank_script.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    with open(os.path.join(local_dir, "helper_mod.py"), "w") as f:
        f.write("VALUE = 42\n")
    job = launch([script, "go", "x"], nodes=["a", "b"], ranks_per_node=1, base_dir=local_dir,
                 env={"TAG": "t1"}, rank_env={1: {"TAG": "t2"}})
    assert job.wait(60) == [3, 4]
    out0, out1 = job.output(0), job.output(1)
    assert "argv ['go', 'x'] rank 0 tag t1" in out0 and "argv ['go', 'x'] rank 1 tag t2" in out1
    assert "main __main__ 42" in out0

    job = launch([script, "sleep"], nodes=["a"], ranks_per_node=1, base_dir=local_dir)
    deadline = time.monotonic() + 30
    while "main __main__" not in job.output(0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the rank is up and sleeping
    assert "main __main__" in job.output(0), job.output(0)
    os.kill(job.procs[0].pid, signal.SIGKILL)
    assert job.wait(30) == [-signal.SIGKILL]
