"""Fork writer processes from one that already imported torch (test suites only).

Every ``Checkpointer(writer="process")`` starts a writer as a fresh interpreter, which
imports torch: about two seconds of CPU here, and a test suite starts hundreds of them.
This server is one fresh interpreter that imports the writer's modules once and forks a
writer per request. A trainer whose environment names the server
(``INCLUSTER_TEST_WRITER_SERVER``, a Unix socket path) asks it instead of starting
``python -m incluster.writer.worker``; each writer is still a process of its own, with
the trainer's environment, working directory, stdout and stderr, and its end of the
trainer's socket pair. The server tells the asking trainer the writer's pid and, when
it ends, its exit status (:class:`Served` mirrors ``subprocess.Popen``). A writer is
killed when its trainer ends, as the parent-death signal does for a writer the trainer
started itself (a thread watching the trainer's pidfd), and when the server ends, which
ends with the process that started it.

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
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ENV = "INCLUSTER_TEST_WRITER_SERVER"


class Served:
    """A writer forked by the server, as ``subprocess.Popen`` shows a process."""

    def __init__(self, conn: socket.socket, fd: int, env: dict[str, str]) -> None:
        self._conn = conn
        req = json.dumps({"env": env, "cwd": os.getcwd()}).encode() + b"\n"
        socket.send_fds(self._conn, [req], [fd, 1, 2])
        self._buf = b""
        self._lock = threading.Lock()  # poll() and wait() come from the trainer's threads
        self.returncode: int | None = None
        try:
            self.pid: int = int(self._read_line(60.0)["pid"])
        except (subprocess.TimeoutExpired, KeyError, ValueError) as exc:
            # Never a fresh writer now: the server has this socket pair's end and may still fork one.
            raise OSError(f"the test writer server took the request but named no writer ({exc!r})") from None

    def _read_line(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired("writer", timeout or 0)
            chunk = self._conn.recv(4096)
            if not chunk:  # the server is gone: so is every writer it forked
                self._buf += json.dumps({"exit": -signal.SIGKILL}).encode() + b"\n"
                break
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        if "exit" in msg:
            self._conn.close()  # the last word
        return msg

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
        if self.poll() is None:  # an ended writer's pid may be another process's by now
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def start(fd: int, env: dict[str, str]) -> Served | None:
    """A writer from the server the environment names; None: start a fresh interpreter."""
    path = os.environ.get(ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None  # no server (any more): the usual way
    return Served(conn, fd, env)  # past here a failure is an error, never a second writer


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


def _die_with(trainer: int) -> None:
    """The parent-death signal follows the server, not the trainer: this thread gives the
    writer the same end when its trainer ends (a pidfd where the kernel has them)."""
    def watch() -> None:
        try:
            fd = os.pidfd_open(trainer)
            select.select([fd], [], [])
        except (OSError, AttributeError):
            while True:
                try:
                    with open(f"/proc/{trainer}/stat") as f:
                        if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                            break
                except OSError:
                    break
                time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="incluster-trainer-watch", daemon=True).start()


def _child(fds: list[int], req: dict[str, Any], trainer: int) -> None:
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
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    _die_with(trainer)
    code = 0
    try:
        from incluster.writer import worker

        worker.main()  # ends the process itself when it ends well
    except SystemExit as exc:  # as the interpreter ends on it
        c = exc.code
        code = 0 if c is None else c if isinstance(c, int) else (print(c, file=sys.stderr) or 1)
    except BaseException:  # noqa: BLE001 - a crash, as an interpreter would show it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
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
        fds: list[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            req = json.loads(msg.split(b"\n", 1)[0])
            trainer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))[0]
            if len(fds) != 3:
                raise ValueError(f"{len(fds)} file descriptors")
        except (OSError, ValueError) as exc:
            print(f"incluster writer server: a bad request ({exc})", file=sys.stderr)
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for c in writers.values():
                c.close()
            _child(list(fds), req, trainer)
        for fd in fds:
            os.close(fd)
        writers[pid] = conn
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:  # the trainer is gone already: its writer follows it (_die_with)
            pass


if __name__ == "__main__":
    _serve(sys.argv[1])
