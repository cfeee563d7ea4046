"""Say which ranks a collective call waits for, while it waits.

``load()`` is collective: a rank that calls it alone (``if rank == 0: ckpt.load(...)``)
waits in the process group's first collective until its timeout (30 min with gloo),
saying nothing. Each rank marks its arrival in the job store; while the call runs, a
thread on every rank checks who has arrived and, past ``WARN_S``, logs once which ranks
have not and what to do. It never fails the call: a rank that is merely slow (a long
data-loader start) still joins, and the call goes on as before.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from incluster.commit import StoreAddress

log = logging.getLogger("incluster")
WARN_S = 30.0  # a rank this late is more likely not calling at all than slow
POLL_S = 1.0


class ArrivalWatch:
    """Context manager around the ``n``-th call of ``what`` on this rank."""

    def __init__(self, addr: StoreAddress | None, rank: int, what: str, n: int, warn_s: float | None = None) -> None:
        self.addr, self.rank, self.what, self.n = addr, rank, what, n
        self.warn_s = WARN_S if warn_s is None else warn_s
        self._done = threading.Event()

    def _key(self, rank: int | None = None) -> str:
        assert self.addr is not None
        base = f"incluster/{self.addr.job}/arrived/{self.what}/{self.n}"
        return base if rank is None else f"{base}/{rank}"

    def __enter__(self) -> "ArrivalWatch":
        if self.addr is None or self.addr.world_size < 2:
            return self
        try:
            from torch.distributed import TCPStore

            store = TCPStore(self.addr.host, self.addr.port, is_master=False,
                             timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
            store.set(self._key(self.rank), "1")  # who: read once, only to name the missing
            store.add(self._key(), 1)  # how many: one O(1) request per poll
        except Exception as exc:  # noqa: BLE001 - only a diagnostic: the call itself goes on
            log.debug("incluster: rank %d: arrival at %s not recorded: %s", self.rank, self.what, exc)
            return self
        threading.Thread(target=self._watch, args=(store,), name="incluster-arrival", daemon=True).start()
        return self

    def _watch(self, store: Any) -> None:
        assert self.addr is not None
        world = self.addr.world_size
        waited = 0.0
        while not self._done.wait(POLL_S):
            waited += POLL_S
            try:
                if int(store.add(self._key(), 0)) >= world:
                    return
                if waited < self.warn_s:
                    continue
                missing = [r for r in range(world) if not store.check([self._key(r)])]
            except Exception:  # noqa: BLE001 - the store went away: nothing more to say
                return
            if missing:
                log.warning(
                    "incluster: rank %d has waited %.0f s in %s for rank(s) %s, which have not called it: "
                    "%s is collective - every rank must call it, with the same Checkpointer settings (not "
                    "under `if rank == 0:`); this rank waits until they do or the process group times out",
                    self.rank, waited, self.what, ranges(missing), self.what)
                return

    def __exit__(self, *exc: object) -> None:
        self._done.set()


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (a large job's list stays one line)."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
