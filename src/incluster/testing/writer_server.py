"""Fork writer processes from one that already imported torch (test suites only).

Every ``Checkpointer(writer="process")`` starts a writer as a fresh interpreter, which
imports torch: about two seconds of CPU here, and a test suite starts hundreds of them.
This server is one fresh interpreter that imports the writer's modules once and forks a
writer per request. A trainer whose environment names the server
(``INCLUSTER_TEST_WRITER_SERVER``, a Unix socket path) asks it instead of starting
``python -m incluster.writer.worker``; each writer is still a process of its own, with
the trainer's environment, working directory, stdout and stderr, and its end of the
trainer's socket pair. The server tells the asking trainer the writer's pid and, when
it ends, its exit status (:class:`Served` mirrors ``subprocess.Popen``). A writer ends
when its trainer's socket closes (as every writer does); its parent-death signal
follows the server, which ends with the process that started it.

    server = WriterServer()            # python -m incluster.testing.writer_server PATH
    os.environ[ENV] = server.path      # every Checkpointer started from here on
    ...
    server.close()

Not for production jobs: there each writer is a fresh interpreter, as it should be.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ENV = "INCLUSTER_TEST_WRITER_SERVER"


class Served:
    """A writer forked by the server, as ``subprocess.Popen`` shows a process."""

    def __init__(self, path: str, fd: int, env: dict[str, str]) -> None:
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(path)
        req = json.dumps({"env": env, "cwd": os.getcwd()}).encode() + b"\n"
        socket.send_fds(self._conn, [req], [fd, 1, 2])
        self._buf = b""
        self._lock = threading.Lock()  # poll() and wait() come from the trainer's threads
        self.returncode: int | None = None
        self.pid: int = int(self._read_line(30.0)["pid"])

    def _read_line(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired("writer", timeout or 0)
            chunk = self._conn.recv(4096)
            if not chunk:  # the server is gone: so is every writer it forked
                return {"exit": -signal.SIGKILL}
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):  # held: a wait() reads it
            try:
                if self.returncode is None:
                    self.returncode = int(self._read_line(0.0)["exit"])
            except subprocess.TimeoutExpired:
                pass
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                self.returncode = int(self._read_line(timeout)["exit"])
            return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def start(fd: int, env: dict[str, str]) -> Served | None:
    """A writer from the server the environment names; None: start a fresh interpreter."""
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        return Served(path, fd, env)
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
        return None  # no server (any more): the usual way


class WriterServer:
    """The server process, started by a test session."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="incluster-writers-")
        self.path = os.path.join(self._dir, "server.sock")
        self._proc = subprocess.Popen([sys.executable, "-m", "incluster.testing.writer_server", self.path],
                                      stdin=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the writer server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the server ends at EOF
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


def _child(fds: list[int], req: dict[str, Any]) -> None:
    sock, out, err = fds
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (out, err):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = ["incluster.writer.worker", str(sock)]
    code = 0
    try:
        from incluster.writer import worker

        worker.main()  # ends the process itself when it ends well
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a crash, as an interpreter would show it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _serve(path: str) -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the test session
    import torch  # noqa: F401 - the point of the server
    import incluster.writer.service  # noqa: F401
    import incluster.writer.worker  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # appears once it can be connected to
    listener.listen(64)
    writers: dict[int, socket.socket] = {}  # pid -> the asking trainer's connection
    while True:
        ready = select.select([listener, sys.stdin], [], [], 0.05)[0]
        while True:  # report ended writers
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = writers.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            return
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            req = json.loads(msg.split(b"\n", 1)[0])
        except (OSError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for c in writers.values():
                c.close()
            _child(list(fds), req)
        for fd in fds:
            os.close(fd)
        writers[pid] = conn
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    _serve(sys.argv[1])
