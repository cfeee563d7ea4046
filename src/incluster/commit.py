"""The global commit protocol: O(1) store operations per rank per save, no collective.

Rank 0's Checkpointer hosts a ``torch.distributed.TCPStore`` (OS-chosen port; the
address is shared once over the default group when the Checkpointer is created).
Writers connect as clients. For step N (keys under ``<job>/``):

- ``c/N``  each rank ``add``s 1 after its shard (and, later, each replica) commits;
- ``o/N``  the outcome: the rank whose ``add`` completes the count sets ``ok``; a rank
  whose save of N failed sets ``fail:<rank>:<why>`` (the count can then never complete,
  so the two never race);
- ``n/T/P`` the step saved after step P (and its number), set by the first rank there:
  a rank that saved another step after P finds out at once (every rank must save the
  same steps; writer/sequence.py);
- ``latest`` the newest globally committed step, raised monotonically (compare-and-set).

The per-step keys of the saves made after the ranks' T-th ``load()`` live under ``t<T>/``
(:meth:`Coordinator.at`): a load() can go back past a durable step (every copy of it
lost), and the same step number saved again is a new step. Read under the old key, its
count was complete and its outcome "ok" before any rank committed it.

Every wait is bounded; a timeout names how many ranks had committed. The protocol state
of a step is an enum (:class:`Outcome`), never a pair of flags.
"""

from __future__ import annotations

import copy
import datetime
import enum
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

from incluster.errors import CommitError, PeerTimeoutError, StoreLostError


class Outcome(enum.Enum):
    COMMITTED = "ok"
    FAILED = "fail"


@dataclass(frozen=True)
class StoreAddress:
    """Where the job store listens and what a save needs to be complete (picklable)."""

    host: str
    port: int
    job: str
    world_size: int
    copies_per_rank: int = 1  # 1 + replicas
    run: str = ""  # rank 0's process's run id (process_run): every rank's persistent manifests carry it
    started: int = 0  # rank 0's clock (ns) when the job store started: the run's timelines (recovery/lineage.py)

    @property
    def quorum(self) -> int:
        return self.world_size * self.copies_per_rank


class Coordinator(Protocol):
    def at(self, timeline: int) -> "Coordinator":
        """The same client, for the steps saved after ``timeline`` load() calls (their
        keys apart from every other timeline's)."""

    def committed(self, step: int) -> None:
        """Count one committed copy of ``step``; completes the step if it is the last."""

    def forced(self, step: int) -> int:
        """Count this rank as one that uploads ``step`` (before its commit is counted)."""

    def forced_count(self, step: int) -> int:
        """How many ranks upload ``step`` (final once it committed)."""

    def outcome(self, step: int, timeout: float) -> str | None:
        """``step``'s outcome once decided, None if not within ``timeout``: only reads
        (:meth:`wait_outcome` decides a step it timed out on as failed, for every rank)."""

    def failed(self, step: int, reason: str) -> str:
        """Tell every rank that ``step`` can never commit, unless it is decided already;
        returns the step's outcome as it now stands (``ok`` if it had committed)."""

    def wait_outcome(self, step: int, timeout: float) -> None:
        """Return once ``step`` is globally committed; CommitError/PeerTimeoutError else."""

    def successor(self, timeline: int, prev: int, step: int, number: int) -> tuple[int, int, int]:
        """Record ``step`` (numbered ``number``) as the save after ``prev`` unless a rank
        did first; returns the step, number and rank recorded (see writer/sequence.py)."""

    def persisted(self, step: int, info: str) -> bool:
        """Record this rank's upload of ``step`` (``info``: its size and checksum, JSON);
        True for the rank that completes the count: it writes the manifest."""

    def persist_infos(self, step: int) -> list[str]:
        """Every rank's upload record of ``step`` (manifest writer only)."""

    def persist_outcome(self, step: int, value: str | None, timeout: float) -> str:
        """Set (value given) or wait for (value None) ``step``'s persistent outcome."""

    def persist_gate(self, step: int, value: str | None, timeout: float) -> str:
        """Rank 0 sets (value given), the other ranks wait for (value None), whether
        ``step``'s upload may write: "ok", or "fail:0:why". First value wins."""

    def close(self) -> None: ...


class SoloCoordinator:
    """World size 1 without a store: the local commit is the global commit."""

    def __init__(self) -> None:
        self._t = 0  # the timeline of this view (at())
        self._outcomes: dict[tuple[int, int], str] = {}
        self._infos: dict[tuple[int, int], str] = {}
        self._persist: dict[tuple[int, int], str] = {}

    def at(self, timeline: int) -> SoloCoordinator:
        view = copy.copy(self)  # the same records, keyed apart
        view._t = timeline
        return view

    def committed(self, step: int) -> None:
        self._outcomes[(self._t, step)] = Outcome.COMMITTED.value

    def forced(self, step: int) -> int:
        return 1

    def forced_count(self, step: int) -> int:
        return 1

    def outcome(self, step: int, timeout: float) -> str | None:
        return self._outcomes.get((self._t, step))

    def failed(self, step: int, reason: str) -> str:
        return self._outcomes.setdefault((self._t, step), f"{Outcome.FAILED.value}:0:{reason}")

    def wait_outcome(self, step: int, timeout: float) -> None:
        _raise_for(step, self._outcomes.get((self._t, step), Outcome.COMMITTED.value))

    def successor(self, timeline: int, prev: int, step: int, number: int) -> tuple[int, int, int]:
        return step, number, 0

    def persisted(self, step: int, info: str) -> bool:
        self._infos.clear()  # one upload at a time
        self._infos[(self._t, step)] = info
        return True

    def persist_infos(self, step: int) -> list[str]:
        return [self._infos[(self._t, step)]]

    def persist_outcome(self, step: int, value: str | None, timeout: float) -> str:
        if value is not None:
            return self._persist.setdefault((self._t, step), value)  # first value wins, as in the store
        return self._persist.get((self._t, step), "fail:0:no outcome")

    def persist_gate(self, step: int, value: str | None, timeout: float) -> str:
        return "ok" if value is None else value  # one rank: it is rank 0, and decides alone

    def close(self) -> None:
        pass


def failed_on(message: str) -> int | None:
    """The rank a job-store verdict names ("step N failed on rank R (...)"), else None."""
    m = re.match(r"step \d+ failed on rank (\d+) ", message)
    return int(m.group(1)) if m else None


def _raise_for(step: int, value: str) -> None:
    if value == Outcome.COMMITTED.value:
        return
    _, rank, why = (value.split(":", 2) + ["?", "?"])[:3]
    raise CommitError(
        f"step {step} failed on rank {rank} ({why}); it will not be restored by any rank - "
        f"the previous committed step stays the newest"
    )


class StoreCoordinator:
    """A client of the job's TCPStore. One per thread that blocks on it."""

    def __init__(self, addr: StoreAddress, rank: int, timeout: float = 60.0) -> None:
        from incluster.store_client import connect

        self.addr = addr
        self.rank = rank
        self._latest_seen = ""
        self._base = f"incluster/{addr.job}/"
        self._p = self._base  # where this view's per-step keys live (at())
        self.store: Any = connect(addr.host, addr.port, timeout)  # a lost store raises StoreLostError, in words

    def at(self, timeline: int) -> StoreCoordinator:
        view = copy.copy(self)  # the same client, its per-step keys apart
        view._p = self._base if timeline == 0 else f"{self._base}t{timeline}/"
        return view

    def _k(self, kind: str, step: int | None = None) -> str:
        return f"{self._base}{kind}" if step is None else f"{self._p}{kind}/{step}"

    def forced(self, step: int) -> int:
        return int(self.store.add(self._k("f", step), 1))

    def forced_count(self, step: int) -> int:
        return int(self.store.add(self._k("f", step), 0))

    def outcome(self, step: int, timeout: float) -> str | None:
        try:
            self.store.set_timeout(datetime.timedelta(seconds=timeout))
            return self.store.get(self._k("o", step)).decode()
        except Exception:  # noqa: BLE001 - not decided in time, or the store is gone
            return None

    def committed(self, step: int) -> None:
        n = self.store.add(self._k("c", step), 1)
        if n < self.addr.quorum:
            return
        got = self.store.compare_set(self._k("o", step), "", Outcome.COMMITTED.value).decode()
        if got == Outcome.COMMITTED.value:  # not a step a rank already gave up on (FAILED first)
            self._raise_latest(step)

    def _raise_latest(self, step: int) -> None:
        key = self._k("latest")
        expected = self._latest_seen  # usually right: one round trip
        for _ in range(64):  # a few racing completions at most; bounded regardless
            cur = self.store.compare_set(key, expected, str(step)).decode()
            if cur == str(step) or (cur and int(cur) >= step):
                self._latest_seen = cur
                return
            expected = cur

    def failed(self, step: int, reason: str) -> str:
        value = f"{Outcome.FAILED.value}:{self.rank}:{reason.replace(chr(10), ' ')[:500]}"
        return self.store.compare_set(self._k("o", step), "", value).decode()

    def successor(self, timeline: int, prev: int, step: int, number: int) -> tuple[int, int, int]:
        got = self.store.compare_set(f"{self._base}n/{timeline}/{prev}", "", f"{step}:{number}:{self.rank}").decode()
        won, n, by = (got.split(":") + ["", ""])[:3]
        return int(won), int(n) if n else number, int(by) if by else -1

    def settle(self, step: int, reason: str) -> str:
        """A writer died with ``step`` in flight: decide the step for every rank, once.
        Complete if every copy was counted (the dead writer's count may have completed it
        before it could publish so), else failed; returns the outcome as it now stands."""
        if int(self.store.add(self._k("c", step), 0)) >= self.addr.quorum:
            got = self.store.compare_set(self._k("o", step), "", Outcome.COMMITTED.value).decode()
            if got == Outcome.COMMITTED.value:
                self._raise_latest(step)
            return got
        return self.failed(step, reason)

    def wait_outcome(self, step: int, timeout: float) -> None:
        key = self._k("o", step)
        try:
            # get() itself waits for the key, up to the store's timeout: one round trip.
            self.store.set_timeout(datetime.timedelta(seconds=timeout))
            value = self.store.get(key).decode()
        except Exception as exc:  # DistStoreError on timeout, or the store went away
            if "timeout" not in str(exc).lower():
                raise StoreLostError(f"lost the job store while waiting for step {step}: {exc}") from None
            try:
                n = int(self.store.add(self._k("c", step), 0))
                why = (f"step {step} was not committed by every rank within {timeout:.0f} s "
                       f"({n} of {self.addr.quorum} copies committed)")
                # Given up here, so failed for every rank: a late rank's commit must not make
                # it durable elsewhere (its copy would be the newest step on some ranks only).
                value = self.store.compare_set(
                    key, "", f"{Outcome.FAILED.value}:{self.rank}:{why} (timed out waiting)").decode()
            except Exception as lost:  # noqa: BLE001 - gone meanwhile: nobody can tell the outcome now
                raise StoreLostError(f"lost the job store while deciding step {step} after a timeout: {lost}") from None
            if value.startswith(Outcome.FAILED.value) and not value.startswith(f"{Outcome.FAILED.value}:{self.rank}:"):
                _raise_for(step, value)  # another rank's verdict came first: its reason
            if value != Outcome.COMMITTED.value:  # else the last commit came in just now
                raise PeerTimeoutError(
                    f"{why}; a rank or its writer is stuck or dead, or a rank called save({step}) "
                    f"later than slot_timeout_s after this one (every rank must save the same steps)"
                ) from None
        _raise_for(step, value)

    def persisted(self, step: int, info: str) -> bool:
        self.store.set(self._k("pr", step) + f"/{self.rank}", info)
        return int(self.store.add(self._k("p", step), 1)) == self.addr.world_size

    def persist_infos(self, step: int) -> list[str]:
        keys = [self._k("pr", step) + f"/{r}" for r in range(self.addr.world_size)]
        return [v.decode() for v in self.store.multi_get(keys)]

    def persist_outcome(self, step: int, value: str | None, timeout: float) -> str:
        return self._set_or_wait(self._k("po", step), value, timeout, "no outcome")

    def persist_gate(self, step: int, value: str | None, timeout: float) -> str:
        return self._set_or_wait(self._k("pg", step), value, timeout, "rank 0 did not open the upload")

    def _set_or_wait(self, key: str, value: str | None, timeout: float, missing: str) -> str:
        if value is not None:
            return self.store.compare_set(key, "", value).decode()
        self.store.set_timeout(datetime.timedelta(seconds=timeout))
        try:
            return self.store.get(key).decode()
        except Exception as exc:  # noqa: BLE001 - a timeout or a lost store: not persisted
            return f"fail:?:{missing} within {timeout:.0f} s ({str(exc)[:80]})"

    def close(self) -> None:
        self.store = None  # type: ignore[assignment]


def host_store(job: str, world_size: int, copies_per_rank: int = 1) -> tuple[object, StoreAddress]:
    """Rank 0 only: start the job store on an OS-chosen port; returns (server, address).

    The address is ``MASTER_ADDR`` when set, else this host's name.
    """
    import socket

    from torch.distributed import TCPStore

    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    server = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    return server, StoreAddress(host, int(server.port), job, world_size, copies_per_rank, process_run(), time.time_ns())


_run_id: str | None = None


def process_run() -> str:
    """This process's run id (rank 0's is every rank's: ``StoreAddress.run``). Drawn once
    per process, so the Checkpointers one after another of a training process (Lightning
    makes one per ``fit``) are one run, and again in a forked child, which is another."""
    global _run_id
    if _run_id is None:
        import uuid

        _run_id = uuid.uuid4().hex
    return _run_id


def _forget_run() -> None:
    global _run_id
    _run_id = None


os.register_at_fork(after_in_child=_forget_run)
