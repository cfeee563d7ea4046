"""The trainer's side of the writer process (``writer="process"``, the default).

One writer process per trainer rank, started once as a fresh interpreter
(``python -m incluster.writer.worker``) connected by a socket pair: like the spawn start
method, but it never re-imports the trainer's ``__main__``, so a training script without
an ``if __name__ == "__main__"`` guard cannot start a second training run by accident.

Handshake with a timeout (awaited on a thread of its own with ``wait=False``); typed
messages with a generation id; a receiver thread turns replies into futures. If the writer dies, every pending save fails with
:class:`WriterProcessDied` carrying its pid and exit code; the Checkpointer then starts a new writer for the
next save (``Checkpointer._live_writer``).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any

from incluster.errors import CommitError, PeerTimeoutError, StoreLostError, WriterProcessDied
from incluster.staging.slots import Slot
from incluster.writer.local_commit import CommitRequest
from incluster.writer import protocol
from incluster.writer.protocol import Kind, Message, WriterParams

_gens = itertools.count(1)
log = logging.getLogger("incluster")


def _describe(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessWriter:
    """``wait=False`` returns once the process is started and greeted: its answer (after
    it imported torch and reached the job store, about a second) is awaited on a thread
    of its own, so the caller's work (a restore) overlaps the start. Messages sent
    meanwhile queue in order behind the greeting; a start that fails is a writer death
    (:meth:`wait_started` raises it; pending saves fail with it)."""

    def __init__(
        self, params: WriterParams, on_persisted: Any = None, handshake_timeout_s: float = 120.0, on_death: Any = None,
        wait: bool = True,
    ) -> None:
        self.params = params
        self._on_persisted = on_persisted
        self._on_death_cb = on_death  # called once, on the thread that found the writer gone
        self.gen = params.gen
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The writer never needs intra-op parallelism; an OpenMP pool would spin on the
        # cores the trainer is using after every small torch op the writer makes.
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
        from incluster.testing import writer_server

        # A test suite's writer server forks it from a process that imported torch already
        # A session of its own: a signal to the trainer's process group (torchrun stopping its
        # workers with SIGTERM, `timeout`, Ctrl-C in a terminal) does not reach the writer,
        # which the trainer's handler may still need for a last save. It ends with its
        # trainer anyway (parent-death signal, and its socket's end).
        self.proc: Any = writer_server.start(theirs.fileno(), env) or subprocess.Popen(
            [sys.executable, "-m", "incluster.writer.worker", str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        theirs.close()
        self.pid: int | None = self.proc.pid
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._tx = ThreadPoolExecutor(1, thread_name_prefix="incluster-writer-tx")
        # Longer than the writer may legitimately be busy between reads (a commit, then a
        # replication that waits up to the timeout for each of its rounds).
        self.send_timeout_s = 3 * params.outcome_timeout_s
        self._hung: str | None = None
        self._pending: dict[int, tuple[Future[tuple[str, bool]], Future[None]]] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._dead: WriterProcessDied | None = None
        self._bye = threading.Event()
        self._gone = threading.Event()  # BYE received, or the process found dead
        self.drain_listener: Any = None  # staging.remote_drain.RemoteDrain (gpu_drain="writer")
        self._started: Future[None] = Future()
        self._early_fails: list[tuple[int, str, tuple[int, int, int] | None]] = []  # sent before it answered
        self._early_replicates: list[tuple[str, int]] = []  # likewise
        # REPLICATE requests this writer never read (it died starting, or could not be
        # sent): its successor is sent them (Checkpointer._live_writer)
        self.unsent_replicates: list[tuple[str, int]] = []
        self._send(Message(Kind.HELLO, self.gen, payload=params))
        if wait:
            try:
                self._handshake(handshake_timeout_s)
            except BaseException as exc:
                self._started.set_exception(exc)
                raise
        else:
            threading.Thread(target=self._handshake_behind, args=(handshake_timeout_s,),
                             name="incluster-writer-hello", daemon=True).start()

    def _handshake(self, timeout: float) -> None:
        """The writer's answer to HELLO, then the receiver thread; raises why not."""
        if not self.conn.poll(timeout):
            self.proc.kill()
            raise WriterProcessDied(
                f"the writer process (pid {self.pid}) did not answer within {timeout:.0f} s; "
                f"check that `python -m incluster.writer.worker` can start in this environment"
            )
        try:
            hello = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.wait(10)
            raise WriterProcessDied(f"the writer process (pid {self.pid}) {_describe(code)} during start-up") from None
        if hello.kind is not Kind.HELLO:
            self.proc.wait(10)
            raise WriterProcessDied(f"the writer process (pid {self.pid}) could not start: {hello.error}")
        self._heard = time.monotonic()
        self._rx_busy = False
        self._receiver = threading.Thread(target=self._receive, name="incluster-writer-rx", daemon=True)
        self._receiver.start()
        threading.Thread(target=self._watch, name="incluster-writer-watch", daemon=True).start()
        with self._lock:
            self._early_fails = []  # the writer takes them, in order, behind the greeting
            self._early_replicates = []
        self._started.set_result(None)

    def _handshake_behind(self, timeout: float) -> None:
        try:
            self._handshake(timeout)
        except Exception as exc:  # noqa: BLE001 - a death like any other: pending saves fail with it
            err = exc if isinstance(exc, WriterProcessDied) else WriterProcessDied(
                f"the writer process (pid {self.pid}) could not start: {type(exc).__name__}: {exc}")
            self._on_death(err)  # dead before anyone waiting on the start hears of it
            with self._lock:
                early, self._early_fails = self._early_fails, []
            for step, reason, seq in early:  # the writer never read them: tell the other ranks from here
                self._publish_failed(step, reason, seq)
            self._started.set_exception(err)

    @property
    def started(self) -> "Future[None]":
        """Resolves when the writer answered its greeting (an exception: it did not start)."""
        return self._started

    def wait_started(self, timeout: float | None = None) -> None:
        """Until the writer answered its greeting; raises why it did not start."""
        self._started.result(timeout)

    @property
    def dead(self) -> WriterProcessDied | None:
        """Why the writer process is gone; None while it runs."""
        return self._dead

    def _send(self, msg: Message) -> None:
        """Send on a helper thread and wait at most ``send_timeout_s``: a writer that does
        not read its socket for that long (stopped, deadlocked) is killed - the usual
        restart path takes over - instead of blocking the staging thread for ever."""
        with self._send_lock:
            try:
                fut = self._tx.submit(self.conn.send, msg)
            except RuntimeError:  # thread pools are shut down: the interpreter is exiting (an atexit close())
                self.conn.send(msg)
                return
            try:
                fut.result(self.send_timeout_s)
            except FutureTimeout:
                self._hung = f"took no message for {self.send_timeout_s:.0f} s and was killed"
                self.proc.kill()
                raise TimeoutError(f"the writer process (pid {self.pid}) {self._hung}") from None

    def submit(self, req: CommitRequest, slot: Slot) -> "tuple[Future[tuple[str, bool]], Future[None]]":
        local: Future[tuple[str, bool]] = Future()
        outcome: Future[None] = Future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            seq = next(self._seq)
            self._pending[seq] = (local, outcome)
        try:
            self._send(Message(Kind.COMMIT, self.gen, seq, req.step, req))
        except OSError:
            self._on_death()
            raise self._dead or WriterProcessDied("the writer process is gone") from None
        return local, outcome

    def fail(self, step: int, reason: str, seq: tuple[int, int, int] | None = None) -> None:
        # Under the lock the start's failure sets ``_dead`` and takes the early fails: a
        # FAIL is either among those (told from here should the start fail) or sent to a
        # writer known alive, or - the writer gone - told from here. Read outside the lock,
        # a start failing in between left it to a send that may land in a dead socket.
        with self._lock:
            dead = self._dead
            if dead is None and not self._started.done():
                self._early_fails.append((step, reason, seq))
        if dead is None:
            try:
                self._send(Message(Kind.FAIL, self.gen, step=step, error=reason, payload=seq))
                return
            except OSError:
                pass
        self._publish_failed(step, reason, seq)

    def _publish_failed(self, step: int, reason: str, seq: tuple[int, int, int] | None) -> None:
        """The writer is gone: tell the other ranks from here, so none of them waits."""
        if self.params.store is not None:
            from incluster.commit import StoreCoordinator

            try:
                coord = StoreCoordinator(self.params.store, self.params.rank, timeout=10)
                coord.at(0 if seq is None else seq[2]).failed(step, reason)
            except Exception:  # noqa: BLE001 - the store is gone too; peers time out instead
                pass

    def share_device_buffer(self, buf_id: int, buf: Any, slots: list[tuple[int, str, int, int]]) -> None:
        """Hand the device-side snapshot buffer to the writer (CUDA IPC: torch's reduction of
        a CUDA tensor; this process keeps the buffer alive) with the slot files it should
        page-lock now; it answers DEVICE_READY."""
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(buf)
        self._send(Message(Kind.DEVICE_BUFFER, self.gen, payload=(buf_id, args, buf.device.index or 0, slots)))

    def pin_slot_files(self, slots: list[tuple[int, str, int, int]]) -> None:
        """Slot files mapped since the buffer was shared: page-locked by the writer now."""
        self._send(Message(Kind.PIN_SLOTS, self.gen, payload=slots))

    def persist_again(self, folder: str, step: int, timeline: int) -> None:
        try:
            self._send(Message(Kind.PERSIST_AGAIN, self.gen, step=step, payload=(folder, timeline)))
        except OSError:
            pass  # a dead writer: close() reports the upload as not made

    def replicate(self, folder: str, step: int) -> None:
        """Re-send ``step``'s replicas in the background (after a restore). One this writer
        never reads (it dies starting, or the send fails) goes to its successor."""
        with self._lock:
            dead = self._dead
            if dead is None and not self._started.done():
                self._early_replicates.append((folder, step))
            elif dead is not None:
                self._unsent((folder, step))
                return
        try:
            self._send(Message(Kind.REPLICATE, self.gen, step=step, payload=folder))
        except OSError:
            with self._lock:
                self._unsent((folder, step))

    def _unsent(self, req: tuple[str, int]) -> None:
        if req not in self.unsent_replicates:
            self.unsent_replicates.append(req)

    def heard_s(self) -> float | None:
        """Seconds since the writer last sent anything (its heartbeat included); None
        before it answered its start."""
        heard = getattr(self, "_heard", None)
        return None if heard is None else time.monotonic() - heard

    def _watch(self) -> None:
        """A writer that sends nothing, not even its heartbeat, for ``STALL_S`` while it
        makes no progress either (no CPU time used, not waiting on I/O: stopped by SIGSTOP
        or a debugger, a frozen cgroup, a deadlock) is killed, so the restart path takes
        over at once. Before, only a send the writer did not read for ``3 x slot_timeout_s``
        found it, and saves' small requests never filled the socket: every save waited out
        ``slot_timeout_s`` for good. Its silence alone is not enough: a long call holding
        its interpreter's lock also stops the heartbeat. Where ``/proc`` cannot tell, it
        is never killed for silence."""
        tick = progress = time.monotonic()
        seen: tuple[str, int] | None = None
        while not self._gone.wait(protocol.HEARTBEAT_S):
            now = time.monotonic()
            if now - tick > 5 * protocol.HEARTBEAT_S or self._rx_busy:
                progress = now  # this process was stopped itself, or is in a callback: words wait unread
            tick = now
            act = _activity(self.pid)
            if act is not None and (act[0] == "D" or (seen is not None and act[1] != seen[1])):
                progress = now  # on CPU, or waiting on I/O: busy, not hung
            seen = act
            quiet = now - max(self._heard, progress)
            if act is None or quiet <= protocol.STALL_S or self.proc.poll() is not None:
                continue
            self._hung = (f"sent nothing, not even its heartbeat, and made no progress for {quiet:.0f} s "
                          f"(state {act[0]}: stopped, or hung) and was killed")
            log.warning("incluster: rank %d: the writer process (pid %s) %s; a new one takes over",
                        self.params.rank, self.pid, self._hung)
            self.proc.kill()
            return

    def _receive(self) -> None:
        while True:
            try:
                msg: Message = self.conn.recv()
            except (EOFError, OSError):
                if not self._bye.is_set():
                    self._on_death()
                return
            self._heard = time.monotonic()
            if msg.gen != self.gen or msg.kind is Kind.ALIVE:
                continue  # a stale reply (never applied to this writer's saves), or a heartbeat
            self._rx_busy = True  # futures' callbacks run here (the user's too): the watchdog waits
            try:
                self._dispatch(msg)
            finally:
                self._rx_busy = False

    def _dispatch(self, msg: Message) -> None:
        if msg.kind is Kind.BYE:
            self._bye.set()
            self._gone.set()
            return
        if msg.kind is Kind.PERSISTED:
            if self._on_persisted is not None:
                self._on_persisted(msg.step, msg.error, msg.payload or 0)  # payload: the save's timeline
            return
        if msg.kind in (Kind.DRAINED, Kind.DEVICE_READY):  # for the trainer's RemoteDrain
            listener = self.drain_listener
            if listener is None:
                return
            if msg.kind is Kind.DRAINED:
                listener.done(msg.step)
            else:
                listener.on_ready(self.gen, msg.payload, msg.error)
            return
        if msg.error_type == "StoreLostError" and self.params.store is not None:  # this process's clients too
            from incluster.store_client import note_lost

            note_lost(self.params.store.host, self.params.store.port, msg.error or "lost the job store")
        with self._lock:
            futs = self._pending.get(msg.seq)
            if futs is not None and msg.kind in (Kind.OUTCOME, Kind.ERROR):
                del self._pending[msg.seq]
        if futs is None:
            return
        local, outcome = futs
        if msg.kind is Kind.LOCAL_DONE:
            local.set_result(msg.payload)
        elif msg.kind is Kind.ERROR:
            err = CommitError(f"writer (pid {self.pid}) failed to commit step {msg.step}: {msg.error}")
            local.set_exception(err)
            outcome.set_exception(err)
        elif msg.kind is Kind.OUTCOME:
            if msg.error is None:
                outcome.set_result(None)
            elif msg.error_type == "StoreLostError":
                outcome.set_exception(StoreLostError(msg.error))
            elif msg.error_type == "PeerTimeoutError":
                outcome.set_exception(PeerTimeoutError(msg.error))
            else:
                outcome.set_exception(CommitError(msg.error))

    def _on_death(self, err: WriterProcessDied | None = None) -> None:
        if self._dead is not None:
            return  # told already (the receiver, a failed send and the start can each find it gone)
        if err is None:
            try:
                code = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            err = WriterProcessDied(
                f"the writer process (pid {self.pid}) {self._hung or _describe(code)}; saves in flight are lost "
                f"(committed steps are intact)"
            )
        with self._lock:
            if self._dead is not None:
                return
            self._dead = err
            pending, self._pending = self._pending, {}
            if not self._started.done():  # died starting: it read nothing sent behind HELLO
                for req in self._early_replicates:
                    self._unsent(req)
                self._early_replicates = []
        self._gone.set()
        for local, outcome in pending.values():
            for f in (local, outcome):
                if not f.done():
                    f.set_exception(err)
        cb, self._on_death_cb = self._on_death_cb, None
        if cb is not None:
            cb()

    def close(self, timeout: float) -> None:
        self._on_death_cb = None  # closing: its end is no death to recover from
        if self._dead is None and self.proc.poll() is None:
            try:
                self._send(Message(Kind.SHUTDOWN, self.gen, payload=timeout))
                self._gone.wait(timeout)  # not the whole timeout if it dies instead of answering
            except OSError:
                pass
        try:
            self.proc.wait(timeout if self._bye.is_set() else 1)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self._tx.shutdown(wait=False)


def _activity(pid: int | None) -> tuple[str, int] | None:
    """(state, CPU clock ticks used) of a process from ``/proc``; None where it cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state; utime + stime
    except (OSError, ValueError, IndexError):
        return None


def next_generation() -> int:
    return next(_gens) + (os.getpid() << 20)
