"""The writer process copies step N+1 out of the device-side snapshot while step N is
still being hashed and committed: only the copy is serial, so saving every k steps keeps
up whenever the copy alone does. The GPU copy is stood in for on CPU
(writer_pipeline_script.py); the rest is the real writer process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest

from incluster.format.checksum import compute
from incluster.format.sidecar import read_sidecar
from incluster.testing import FaultInjector
from incluster.writer.local_commit import CommitRequest
from incluster.writer.protocol import Kind, Message, WriterParams

pytestmark = pytest.mark.multiproc

SCRIPT = os.path.join(os.path.dirname(__file__), "writer_pipeline_script.py")
GEN = 7
SIZE = 3 << 20
CHUNK = 1 << 20
COPY_S = 0.3  # one copy out of the device-side snapshot
COMMIT_S = 1.5  # step 1's commit is this much slower (a slow hash tail, a slow RAM disk)


def _start(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Connection]:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, SCRIPT, str(theirs.fileno()), str(COPY_S)],
                            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(Message(Kind.HELLO, GEN, payload=WriterParams(rank=0, gen=GEN, store=None, outcome_timeout_s=30)))
    assert conn.poll(60), "the writer did not start"
    assert conn.recv().kind is Kind.HELLO
    return proc, conn


def _request(folder: str, slot: int, step: int, buf_id: int = 1) -> CommitRequest:
    path = os.path.join(folder, f".staging-{slot}")
    with open(path, "wb") as f:
        f.truncate(SIZE)
    return CommitRequest(folder=folder, slot=slot, staging_path=path, size=SIZE, job="pipe", step=step, rank=0,
                         world_size=1, node="n0", fingerprint="fp", tree={"d": [["w", {"T": "w"}]]}, chunk=CHUNK,
                         drain=(buf_id, 0, ((0, SIZE),)))


def test_the_next_copy_runs_while_the_previous_step_commits_and_replies_keep_step_order(local_dir):
    folder = os.path.join(local_dir, "pipe", "rank-00000")
    os.makedirs(folder)
    env = dict(os.environ, **FaultInjector().fail_at(phase="commit", step=1, action="slow", seconds=COMMIT_S).env())
    proc, conn = _start(env)
    got: list[tuple[str, int, float]] = []
    try:
        conn.send(Message(Kind.DEVICE_BUFFER, GEN, payload=(1, None, 0, [])))
        t0 = time.perf_counter()
        for seq, step in ((1, 1), (2, 2)):
            conn.send(Message(Kind.COMMIT, GEN, seq, step, _request(folder, seq, step)))
        conn.send(Message(Kind.FAIL, GEN, 3, 3, error="save() raised"))
        conn.send(Message(Kind.COMMIT, GEN, 4, 4, _request(folder, 4, 4, buf_id=99)))  # not open: an error
        conn.send(Message(Kind.SHUTDOWN, GEN, payload=30.0))
        while not got or got[-1][0] != "bye":
            assert conn.poll(60), f"the writer stopped answering; so far {got}"
            msg = conn.recv()
            got.append((msg.kind.value, msg.step, time.perf_counter() - t0))
    finally:
        conn.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    order = [(k, s) for k, s, _ in got if k != "device_ready"]
    at = {(k, s): t for k, s, t in got}
    # Step 2 was copied while step 1 was still committing...
    assert at[("drained", 2)] < at[("local_done", 1)], order
    assert at[("local_done", 1)] - at[("drained", 1)] >= COMMIT_S * 0.5, order
    # A copy that failed frees the buffer at once; its error waits for the steps before it.
    assert at[("drained", 4)] < at[("local_done", 2)], order
    # ...yet every reply about a commit comes in step order, and shut-down waits for them all.
    commits = [(k, s) for k, s in order if k in ("local_done", "error")]
    assert commits == [("local_done", 1), ("local_done", 2), ("error", 4)], order
    assert order[-1] == ("bye", -1) and ("outcome", 1) in order and ("outcome", 2) in order, order
    for step in (1, 2):
        sc = read_sidecar(os.path.join(folder, f"step-{step:012d}.json"))
        with open(os.path.join(folder, f"step-{step:012d}.safetensors"), "rb") as f:
            data = f.read()
        assert data == bytes([step]) * SIZE
        assert sc.checksum == compute(data, SIZE, CHUNK), f"step {step}: the digests are not of the bytes committed"
    assert not os.path.exists(os.path.join(folder, "step-000000000004.json"))
