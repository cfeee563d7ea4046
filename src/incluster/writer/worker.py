"""The writer process's main loop: ``python -m incluster.writer.worker FD``.

Started by :class:`incluster.writer.process.ProcessWriter` as a fresh interpreter (it
never re-imports the trainer's main script). Receives COMMIT requests naming slot files,
maps those files itself (no tensor bytes cross the pipe), commits, counts the commit in
the job store, and reports the local commit and, later, the global outcome.

It exits when the trainer goes away: the pipe reaches EOF, and on Linux the kernel also
sends SIGKILL when the parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import queue
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Callable

from incluster.errors import StoreLostError
from incluster.testing import faults
from incluster.writer.protocol import AGAIN, HEARTBEAT_S, Kind, Message, WriterParams

if TYPE_CHECKING:
    from incluster.writer.local_commit import CommitRequest


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL when the trainer ends. ``parent``: the trainer's pid, which started this
    process - one that died before the signal was asked for (within the second the
    torch import takes) is no longer the parent, and the signal never comes."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: pipe EOF still ends us
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _log_like_the_trainer(level: int) -> None:
    """A trainer that logs incluster's INFO lines (skipped uploads, ...) sees this process's
    too, on the stderr both share; WARNING and above show either way."""
    import logging

    log = logging.getLogger("incluster")
    log.setLevel(level)
    if level < logging.WARNING and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s (writer process)"))
        log.addHandler(handler)
        log.propagate = False


def serve(conn: Connection) -> None:
    from incluster.writer.service import CommitService

    hello = conn.recv()
    if not isinstance(hello, Message) or hello.kind is not Kind.HELLO or not isinstance(hello.payload, WriterParams):
        raise SystemExit("incluster writer: bad handshake")
    params: WriterParams = hello.payload
    gen = params.gen
    _log_like_the_trainer(params.log_level)
    lock = threading.Lock()

    def send(msg: Message) -> None:
        with lock:
            conn.send(msg)

    try:
        faults.check("writer-start", params.rank, params.incarnation)
        service = CommitService(params)
    except Exception as exc:  # noqa: BLE001 - e.g. the job store is unreachable
        send(Message(Kind.ERROR, gen, error=f"writer could not start: {exc}", error_type=type(exc).__name__))
        return
    send(Message(Kind.HELLO, gen, payload=os.getpid()))

    def beat() -> None:  # its silence is how the trainer tells a stopped or hung writer
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                send(Message(Kind.ALIVE, gen))
            except OSError:
                return

    threading.Thread(target=beat, name="incluster-heartbeat", daemon=True).start()

    # (seq, step, timeline): the step's load() count, which keys it in the job store
    outcomes: "queue.Queue[tuple[int, int, int | None] | None]" = queue.Queue()

    def watch() -> None:
        while (item := outcomes.get()) is not None:
            seq, step, timeline = item
            try:
                service.wait_outcome(step, timeline)
                service.on_outcome(step)
                send(Message(Kind.OUTCOME, gen, seq, step))
            except Exception as exc:  # noqa: BLE001 - sent back, raised in the trainer
                if not isinstance(exc, StoreLostError):  # outcome unknown: the replicas held here stay
                    service.on_failed(step)
                send(Message(Kind.OUTCOME, gen, seq, step, error=str(exc), error_type=type(exc).__name__))

    watcher = threading.Thread(target=watch, name="incluster-outcome", daemon=True)
    watcher.start()
    # Replication runs in step order on its own thread: a partner slow to exchange holds
    # up the durability of the steps it owes, never the next local commit.
    replicas: "queue.Queue[Callable[[], None] | None]" = queue.Queue()

    def replicate() -> None:
        while (job := replicas.get()) is not None:
            job()

    def exchange(seq: int, step: int, own: object, watched: bool, timeline: int | None) -> None:
        _replicate(service, step, own, timeline)  # a failure here fails the step's outcome
        if watched:
            outcomes.put((seq, step, timeline))

    def re_replicate(step: int, folder: str) -> None:
        try:
            service.replicate_committed(folder, step)
        except Exception as exc:  # noqa: BLE001 - the next save replicates anyway
            print(f"incluster writer: re-replication of step {step} failed: {exc}", file=sys.stderr)

    replicator = threading.Thread(target=replicate, name="incluster-replicate", daemon=True)
    replicator.start()
    # Commits (and failures and re-replications, which replicate in the same step order)
    # run in order on their own thread: while step N's last chunks are hashed and N is
    # committed, this loop already copies step N+1 out of the device-side snapshot (with
    # keep >= 3, where step N+1 has a slot before step N is durable). Bounded: a commit
    # that hangs stops this loop from reading within a few messages, so the trainer's
    # send times out and it restarts the writer, as when the loop itself committed.
    commits: "queue.Queue[Callable[[], None] | None]" = queue.Queue(maxsize=4)

    def commit() -> None:
        while (job := commits.get()) is not None:
            try:
                job()
            except BaseException:  # a commit thread gone quietly would leave every later save waiting
                traceback.print_exc()
                os._exit(70)  # the trainer sees the writer die and starts another

    def finish(seq: int, step: int, req: CommitRequest, digests: list[Future[str]] | None,
               err: BaseException | None) -> None:
        own = None
        try:
            if err is not None:
                raise err
            if digests is not None:
                req = dataclasses.replace(req, drain=None, digests=tuple(f.result() for f in digests))
            path, own, persist = service.commit(req)
        except Exception as exc:  # noqa: BLE001
            if err is not None or digests is not None:  # before service.commit, which publishes its own
                service.fail(step, f"{type(exc).__name__}: {exc}", req.timeline)
            send(Message(Kind.ERROR, gen, seq, step, error=str(exc), error_type=type(exc).__name__))
            if service.exchanged(step, req.place):  # partners must not wait for us
                replicas.put(partial(exchange, seq, step, None, False, req.timeline))
            return
        send(Message(Kind.LOCAL_DONE, gen, seq, step, payload=(path, persist)))
        if persist:

            def uploaded(err: str | None) -> None:
                send(Message(Kind.PERSISTED, gen, seq, step, payload=req.timeline, error=err))

            if not service.upload(step, own, uploaded, req.timeline, forced=req.persist is True):
                uploaded("skipped: the previous upload was still running")
        replicas.put(partial(exchange, seq, step, own, True, req.timeline))

    def failed(seq: int, step: int, reason: str, order: tuple[int, int, int] | None) -> None:
        timeline = None if order is None else order[2]
        service.fail(step, reason, timeline)
        if service.exchanged(step, order):
            replicas.put(partial(exchange, seq, step, None, False, timeline))

    # A step the others saved and this rank skipped: take part in its exchange, sending nothing.
    service.on_skipped = lambda step, timeline: replicas.put(partial(exchange, 0, step, None, False, timeline))

    committer = threading.Thread(target=commit, name="incluster-commit", daemon=True)
    committer.start()
    drains = None  # device_drain.DeviceDrains, once the trainer shares a device-side snapshot
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the trainer is gone
        if msg.kind is Kind.COMMIT:
            req = msg.payload
            digests, err = None, None
            if req.drain is not None:
                try:
                    if drains is None:
                        raise RuntimeError("no device-side snapshot was shared with this writer")
                    # DRAINED as soon as the buffer is read, before the last hashes finish
                    digests = drains.start(req, partial(send, Message(Kind.DRAINED, gen, msg.seq, msg.step)))
                except Exception as exc:  # noqa: BLE001 - reported in step order by the commit thread
                    err = exc
                    # Nothing reads the buffer any more (start() waited for its copies): the
                    # next snapshot need not wait for the error, which queues behind step N.
                    send(Message(Kind.DRAINED, gen, msg.seq, msg.step))
            commits.put(partial(finish, msg.seq, msg.step, req, digests, err))
        elif msg.kind is Kind.FAIL:
            commits.put(partial(failed, msg.seq, msg.step, msg.error or "failed", msg.payload))
        elif msg.kind is Kind.DEVICE_BUFFER:
            err_text = None
            try:
                if drains is None:
                    from incluster.writer.device_drain import DeviceDrains

                    drains = DeviceDrains(service)
                err_text = drains.open(*msg.payload)
            except Exception as exc:  # noqa: BLE001 - e.g. CUDA cannot start here
                err_text = f"{type(exc).__name__}: {exc}"
            send(Message(Kind.DEVICE_READY, gen, payload=msg.payload[0], error=err_text))
        elif msg.kind is Kind.PIN_SLOTS:
            if drains is not None:
                try:
                    drains.pin_files(msg.payload)
                except Exception as exc:  # noqa: BLE001 - an optimisation: the drain pins what it copies into
                    print(f"incluster writer: could not page-lock slots ahead: {exc}", file=sys.stderr)
        elif msg.kind is Kind.PERSIST_AGAIN:  # behind the commits before it
            def again(step: int = msg.step, folder: str = msg.payload[0], timeline: int = msg.payload[1]) -> None:
                service.upload_committed(folder, step, timeline, lambda err: send(
                    Message(Kind.PERSISTED, gen, 0, step, payload=AGAIN + timeline, error=err)))

            commits.put(again)
        elif msg.kind is Kind.REPLICATE:  # in order with the commits before it
            commits.put(partial(replicas.put, partial(re_replicate, msg.step, msg.payload)))
        elif msg.kind is Kind.SHUTDOWN:
            deadline = time.monotonic() + msg.payload if msg.payload else None

            def left() -> float | None:
                return None if deadline is None else max(0.0, deadline - time.monotonic())

            commits.put(None)
            committer.join(left())
            if committer.is_alive():  # its mappings and pinned memory are still in use: no teardown
                print("incluster writer: a commit did not finish before shut-down; exiting", file=sys.stderr)
                os._exit(71)
            replicas.put(None)
            replicator.join(left())
            outcomes.put(None)
            watcher.join(left())
            if drains is not None:
                try:
                    drains.close()
                except Exception as exc:  # noqa: BLE001 - exiting anyway
                    print(f"incluster writer: releasing the device-side snapshot: {exc}", file=sys.stderr)
            service.close(600.0 if deadline is None else left() or 0.0)
            send(Message(Kind.BYE, gen))
            return


def _replicate(service: object, step: int, own: object, timeline: int | None) -> None:
    try:
        service.replicate(step, own, timeline)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - published as the step's failure; the outcome reports it
        pass


# Signals meant for the trainer: a scheduler's or launcher's "stop" (SLURM and torchrun
# send SIGTERM, Lightning's SLURM requeue SIGUSR1) reaches every process of the job, and
# the trainer's handler may then save once more through this writer; Ctrl-C likewise. The
# writer ends with its trainer (parent-death signal, its socket's end), or SIGKILL.
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _unheeded(signum: int, frame: object) -> None:
    """A stop meant for the trainer (see ``IGNORED``)."""


def main() -> None:
    for sig in IGNORED:  # before the torch import: a second of the start is spent there
        # a handler that does nothing, not SIG_IGN: that would be inherited by the programs
        # the writer runs (a storage client's credential helper), handlers are not
        signal.signal(sig, _unheeded)
    import torch

    torch.set_num_threads(1)  # see ProcessWriter: no intra-op pool spinning beside the trainer
    _die_with_parent(int(sys.argv[2]) if len(sys.argv) > 2 else None)
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    finally:
        conn.close()
    # Everything is committed and reported: skip the interpreter's slow teardown of torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
