"""Which background errors reach the caller, when, and once only.

A save's error reaches the caller through ``wait()``, its handle, or - this rank's own
failures - the next ``save()``; each once (``SaveHandle.reported``). Another rank's
failure is never raised by this rank's ``save()`` (it would fail this rank's new step on
every rank, and so on), and is dropped once a newer step is durable.

Mixin of :class:`~incluster.checkpointer.Checkpointer`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from incluster.errors import CheckpointError, PeerTimeoutError
from incluster.handle import SaveHandle
from incluster.writer.protocol import HEARTBEAT_S, STALL_S


class ErrorReports:
    """Mixin: ``wait()`` and the raising of errors collected in the background."""

    config: Any
    ring: Any
    _closed: bool
    _lock: threading.Lock
    _api_call: Any  # Teardown's
    _pending: list[SaveHandle]
    _errors: list[tuple[SaveHandle, BaseException]]
    _writer: Any
    world_size: int

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far has settled; raise the first background error
        (not another rank's failure, nor a step given up for a newer one while the writer
        started, once a newer step is durable: their handles say why)."""
        self._wait(timeout, mark=True)

    def _locked(self, mark: bool) -> Any:
        """``self._lock``; with ``mark`` (a public wait()), this thread is marked as inside
        wait() while it holds it, so a signal handler's save() there is refused instead of
        deadlocking on it. Only then: a handler's save() while wait() blocks on a save's
        outcome (a preemption during the run's last wait) is the save it means to make."""
        if not mark:
            return self._lock
        with contextlib.ExitStack() as stack:  # what was entered is left again if the next one raises
            stack.enter_context(self._api_call("wait()", lock=False))
            stack.enter_context(self._lock)
            return stack.pop_all()

    def _wait(self, timeout: float | None = None, mark: bool = False) -> None:
        with self._locked(mark):
            pending = [h for h in self._pending if not h.reported]  # each error reaches the caller once
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.slot_timeout_s)
        for h in pending:
            try:
                h.durable.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise PeerTimeoutError(f"step {h.step} did not become durable in time{self._why_late()}") from None
            except BaseException:
                pass  # collected in self._errors, raised below
        with self._locked(mark):
            self._pending = [h for h in self._pending if not h.durable.done()]
        self._raise_errors(mark=mark)

    def _why_late(self) -> str:
        """What a save not durable in time may wait for, for its error."""
        writer = self._writer
        dead = getattr(writer, "dead", None)
        if dead is not None:
            return f": this rank's writer process is gone ({dead}); a new one is starting"
        started = getattr(writer, "started", None)
        if started is not None and not started.done():
            return ": this rank's writer process is still starting (a fresh interpreter importing torch)"
        heard = getattr(writer, "heard_s", None)
        quiet = heard() if callable(heard) else None
        if quiet is not None and quiet > 3 * HEARTBEAT_S:
            return (f": this rank's writer process (pid {writer.pid}) has sent nothing for {quiet:.0f} s, "
                    f"not even its heartbeat (stopped, say by SIGSTOP or a debugger, or hung); after {STALL_S:.0f} s "
                    f"of that it is killed and a new one takes over")
        if self.world_size > 1:
            return ": this rank's writer is answering; another rank, or a replication partner, has not committed it"
        return ""

    def _raise_errors(self, peers: bool = True, mark: bool = False) -> None:
        """Raise the first background error not raised yet, the later ones named in a note
        (each raised once: two failed saves refused two later save() calls before). ``peers=False`` (save()) keeps
        other ranks' failures for wait(): raised by save(), such an error would fail this
        rank's new step too, which the other ranks would then raise at their next save(),
        and so on - no step saved again."""
        newest = self.ring.newest_global
        with self._locked(mark):
            # Another rank's failure of a step older than one durable since: logged when it
            # happened, superseded now (close() would raise it hours later otherwise).
            kept = [e for e in self._errors if not (_from_peer(e[1]) and newest is not None and e[0].step < newest)]
            errors = kept if peers else [e for e in kept if not _from_peer(e[1])]
            self._errors = [e for e in kept if e not in errors]
        errors = [(h, e) for h, e in errors if not h.reported]
        if not errors:
            return
        for handle, _ in errors:  # all of them reach the caller now: none refuses a later save() again
            handle.reported = True
        first = errors[0][1]
        if len(errors) > 1:
            add_note(first, _more_failed(errors[1:]))
        raise first

    def _check_usable(self, peers: bool = True) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")
        self._raise_errors(peers)
        with self._lock:
            self._pending = [h for h in self._pending if not h.durable.done()]


def add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)``; on Python 3.10, which has no notes, appended to its message."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:
        exc.args = (f"{exc.args[0] if exc.args else ''} ({text})", *exc.args[1:])


def _more_failed(later: list[tuple[SaveHandle, BaseException]]) -> str:
    """The note on the first of several background errors raised at once: the others."""
    shown = [f"step {h.step}: {type(e).__name__}: {str(e)[:160]}" for h, e in later[:4]]
    more = f"; and {len(later) - 4} more" if len(later) > 4 else ""
    return f"{len(later)} later save(s) failed too (not raised again): " + "; ".join(shown) + more


def _from_peer(err: BaseException) -> bool:
    """Another rank's failure (tagged by ``SavePipeline._fail``)."""
    return getattr(err, "from_peer", False)
