"""Start rank processes by forking one that already imported torch (tests only).

``import torch`` costs each fresh interpreter about two seconds of CPU here, and
``torch.distributed``, DTensor, FSDP2 and dynamo as much again; a multi-rank test starts
dozens of them. The zygote is one process that imports them once and forks a child per
rank on request. Each child is a real process of its own:
its own environment, working directory, ``argv`` and log file, run as ``python argv``
would run it (``runpy``), exit code or signal reported as ``subprocess.Popen`` reports
it, killable by pid. It dies with the zygote, which dies with the process that
started it.

    with Zygote() as z:          # or launch.use_zygote(z) for every launch()
        p = z.spawn(["script.py", "arg"], env=dict(os.environ), log="/tmp/r0.log")
        p.wait(30)

Not for production jobs: torchrun starts real interpreters, as it should.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

_CHILD = r'''
import ctypes, json, os, select, signal, sys
def _pdeathsig():
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass
_pdeathsig()
import torch  # noqa: F401 - the point of the zygote
# What nearly every rank imports next, at about as much CPU again as torch itself: the
# process group, DTensor and FSDP2, and dynamo (the first optimizer step imports it).
# Modules only: none starts a thread or touches CUDA. Dynamo's and inductor's configs read
# TORCHDYNAMO_* / TORCHINDUCTOR_* here, at import: a rank's own setting of those is not seen.
import torch.distributed, torch.distributed.tensor, torch.distributed.fsdp, torch._dynamo  # noqa: E401,F401
out = os.fdopen(os.dup(1), "w", buffering=1)
def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
buf = b""
while True:
    ready, _, _ = select.select([0], [], [], 0.05)
    reap()
    if not ready:
        continue
    chunk = os.read(0, 1 << 20)
    if not chunk:
        os._exit(0)
    buf += chunk
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _pdeathsig()
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.close(null)
                os.chdir(req["cwd"])
                os.environ.clear()
                os.environ.update(req["env"])
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                code = 0
                import atexit, runpy, traceback
                argv = req["argv"]
                try:
                    if argv[0] == "-m":
                        sys.argv = [argv[1], *argv[2:]]
                        sys.path[0] = req["cwd"]
                        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                    else:
                        sys.argv = list(argv)
                        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                        runpy.run_path(argv[0], run_name="__main__")
                except SystemExit as exc:
                    c = exc.code
                    code = 0 if c is None else c if isinstance(c, int) else (print(c, file=sys.stderr) or 1)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                try:  # an interpreter's own exit: threading's exit hooks (and joins), then atexit
                    import threading
                    threading._shutdown()
                except BaseException:
                    traceback.print_exc()
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        out.write(json.dumps({"pid": pid}) + "\n")
'''


class ZygoteChild:
    """A forked rank, with the part of ``subprocess.Popen``'s interface a job uses."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote._exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote._cond:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
                if not self.zygote._alive:
                    raise RuntimeError("the zygote died; its ranks died with it")
                self.zygote._cond.wait(left if left is not None else 1.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One process that imported torch, forking ranks on request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ)
        )
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._alive = True
        self._spawn_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="incluster-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self._pids.append(int(msg["pid"]))
                self._cond.notify_all()
        with self._cond:
            self._alive = False
            self._cond.notify_all()

    def _exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str], log: str, cwd: str | None = None) -> ZygoteChild:
        req = json.dumps({"argv": list(argv), "env": dict(env), "log": log, "cwd": cwd or os.getcwd()}) + "\n"
        with self._spawn_lock:
            with self._cond:
                seen = len(self._pids)
            assert self.proc.stdin is not None
            self.proc.stdin.write(req.encode())
            self.proc.stdin.flush()
            with self._cond:
                deadline = time.monotonic() + 60
                while len(self._pids) == seen:
                    if not self._alive or time.monotonic() > deadline:
                        raise RuntimeError("the zygote did not start a rank")
                    self._cond.wait(1.0)
                return ZygoteChild(self, self._pids[seen])

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
