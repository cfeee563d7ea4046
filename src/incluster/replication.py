"""Peer replication: writers send their committed shard to the nodes that back them up.

A transport, not a tier: every exchange names the step and the peers, runs with a
timeout, sends metadata first and then raw bytes, and is received in place. Writers form
their own gloo groups (one two-member ``ProcessGroupGloo`` per partner, built on the job
store; no default group involved), so replication never touches the trainer's process group or its GIL.

Per step, in three rounds (tags derived from the step):
1. headers: each rank tells each target ``[step, sidecar bytes, shard bytes]`` (or -1:
   nothing to send, e.g. its own save failed);
2. needs: each target answers 1 if it wants the bytes, 0 if it already holds that step,
   2 if its own shard of the step holds the very same bytes (data-parallel ranks: the
   header carries a digest of the owner's checksum record, compared with the target's);
3. data: the sidecar, then (answer 1) the shard straight from the mapped file into the
   target's replica slot (a reused file under ``<local_dir>/<job>/rank-<owner>/``).

A shared replica (answer 2) is the owner's sidecar alone, written into the owner's folder
with ``extra.shared_with`` naming the target's rank: its bytes are the target's own shard
file of the same step (:func:`incluster.tiers.local.data_path`), so no bytes cross the
network and no RAM is used twice. A restore checks them against the owner's digests like
any copy. Both go when the step is superseded (the target's ring and the replica ring
drop a step only once a newer one is committed everywhere).

The receiver validates the sidecar, checks that it names the owner and step it expects,
verifies every checksum, and only then renames the slot and writes the sidecar; each
committed replica is counted in the job store like a shard. It writes only at paths it
derives itself (owner rank and step), never at a path a peer names.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from incluster.commit import Coordinator, StoreAddress
from incluster.errors import CheckpointError
from incluster.staging.slots import SlotRing
from incluster.tiers.local import rank_folder
from incluster.writer.local_commit import commit_received, parse_received_sidecar

log = logging.getLogger("incluster")
_MAX_SIDECAR = 256 * 1024 * 1024
_SYNC_TAG = 0  # a rebuilt pair's first message (exchange tags are step * 4 + 1..3)


def _room(ring: SlotRing) -> int:
    """Bytes a replica may take in ``ring``'s folder: free space plus the largest slot it
    could reuse."""
    st = os.statvfs(ring.folder)
    return st.f_bavail * st.f_frsize + max((sl.size for sl in ring.slots), default=0)


@dataclass(frozen=True)
class _Work:
    """A pending send or receive, with the partner it is with (for the error that names it)."""

    work: Any
    peer: int


MEET_POLL_S = 0.2  # how often a pairing that waits re-reads its partner's incarnation
PARTNER_NEW = "was started again"  # in a step's failure for a partner's new writer (saving.py tells them by it)
PARTNER_GONE = "writer is gone for good"  # ... or for a partner that saves no more
REPAIR_STEP = 1 << 32  # a repaired pair's incarnations, apart from the trainer's writer restarts (0, 1, 2...)


def writer_key(job: str, rank: int) -> str:
    """The store key that says which incarnation of ``rank``'s writer is up: ``"<n>"``,
    ``"restarting <n>"`` (its trainer is starting incarnation n), or ``"gone"``."""
    return f"incluster/{job}/writer/{rank}/incarnation"


def announce_writer(addr: StoreAddress, job: str, rank: int, state: str, timeout_s: float = 10.0,
                    why: str = "") -> None:
    """The trainer's word on its writer (``"restarting <n>"`` or ``"gone"``), so partners
    wait for the new one, or stop waiting, instead of failing step after step; ``why``:
    what a partner's error should say (a Checkpointer that failed to start)."""
    from incluster.store_client import connect

    client = connect(addr.host, addr.port, timeout_s)
    if why:
        client.set(writer_key(job, rank) + "/why", why)
    client.set(writer_key(job, rank), state)


@dataclass(frozen=True)
class OwnShard:
    """This rank's committed shard for a step: its sidecar JSON and the mapped bytes."""

    sidecar: bytes
    buf: Any  # writable mmap or bytes-like of exactly ``size`` bytes
    size: int
    content: int = 0  # checksum.content_id of the shard (0: unknown, never shared)


class Replicator:
    def __init__(
        self,
        addr: StoreAddress,
        rank: int,
        world_size: int,
        targets: tuple[int, ...],
        sources: tuple[int, ...],
        *,
        local_dir: str,
        job: str,
        node: str,
        keep: int,
        timeout_s: float,
        incarnation: int = 0,
        share: bool = True,
    ) -> None:
        from incluster.store_client import connect

        self.rank, self.job, self.node, self.local_dir = rank, job, node, local_dir
        self.targets = list(targets)
        self.sources = list(sources)
        self.keep, self.share = keep, share
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.incarnation = incarnation
        self._refused: dict[int, str] = {}  # step -> why a partner's replica was refused
        client = connect(addr.host, addr.port, timeout_s)
        self._client = client
        # One two-member gloo group per partner, not one group of all W writers: O(replicas)
        # connections per writer instead of O(W).
        self._pairs: dict[int, tuple[Any, int]] = {}
        self._peer_gen: dict[int, int] = {}  # the partner's incarnation its pair was built with
        partners = sorted(set(self.targets) | set(self.sources))
        client.set(self._gen_key(rank), str(incarnation))
        client.set(f"{self._gen_key(rank)}/{incarnation}/up", "1")
        if incarnation == 0:
            # The job's first writers start together: build every pair now, in ascending
            # (low, high) order on every writer, so the rendezvous never waits in a cycle.
            for peer in partners:
                gen = self._await_first(peer)
                if gen:  # its first writer died starting: paired at the first exchange, as after any restart
                    self._peer_gen[peer] = gen
                    continue
                self._build(peer, 0)  # no step sync: every first writer starts at the same point
        else:
            # A writer started again after its predecessor died: each partner sees the new
            # incarnation at its next exchange, and both sides build the pair then.
            for peer in partners:
                gen = self._current_gen(peer, client.get(self._gen_key(peer)))
                self._peer_gen[peer] = -1 if gen is None else gen
        self.rings: dict[int, SlotRing] = {}

    def _gen_key(self, rank: int) -> str:
        return writer_key(self.job, rank)

    def _current_gen(self, peer: int, value: bytes) -> int | None:
        """The partner's writer incarnation, waiting (up to the timeout) while its trainer
        starts a new one; None if it is gone for good."""
        text = value.decode()
        if text == "gone":
            return None
        if text.startswith("restarting"):
            self._client.wait([f"{self._gen_key(peer)}/{text.split()[1]}/up"], self.timeout)
            return self._current_gen(peer, self._client.get(self._gen_key(peer)))
        return int(text)

    def _await_first(self, peer: int) -> int | None:
        """Until the partner's writer has said which incarnation is up, re-read every 0.2 s;
        returns it (0: its first writer; n: its first died starting and its trainer starts
        the n-th), None when it said nothing within the timeout. A partner whose
        Checkpointer failed to start (a refused folder, say) says it is gone, and this
        writer stops at once, naming why, instead of waiting out a gloo rendezvous."""
        key = self._gen_key(peer)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self._client.check([key]):
            if time.monotonic() >= deadline:
                return None  # the rendezvous that follows times out and says so
            time.sleep(MEET_POLL_S)
        text = self._client.get(key).decode()
        if text == "gone":
            why_key = key + "/why"
            why = self._client.get(why_key).decode() if self._client.check([why_key]) else "its writer is gone"
            raise RuntimeError(f"partner rank {peer} did not start: {why}")
        return int(text.split()[-1])  # "<n>" or "restarting <n>"

    def _pair_key(self, peer: int, peer_gen: int) -> str:
        lo, hi = min(self.rank, peer), max(self.rank, peer)
        if self.incarnation == 0 and peer_gen == 0:
            return f"incluster/{self.job}/pair/{lo}-{hi}"
        g_lo, g_hi = (self.incarnation, peer_gen) if self.rank == lo else (peer_gen, self.incarnation)
        return f"incluster/{self.job}/pair/{lo}-{hi}/{g_lo}-{g_hi}"

    def _build(self, peer: int, peer_gen: int, step: int | None = None) -> int | None:
        """The two-member group with ``peer`` as it is now. After a restart of either
        writer, each side first says it has seen this pair of incarnations and waits for
        the other to say so (so both rendezvous on a fresh prefix once), then they tell
        each other the step they are exchanging: returns the peer's."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        lo = min(self.rank, peer)
        key = self._pair_key(peer, peer_gen)
        if self.incarnation or peer_gen:
            key, peer_gen = self._meet(peer, peer_gen)
        pg = ProcessGroupGloo(PrefixStore(key, self._client.raw), 0 if self.rank == lo else 1, 2, self.timeout)
        self._pairs[peer] = (pg, 1 if self.rank == lo else 0)
        self._peer_gen[peer] = peer_gen
        if step is None:
            return None
        theirs = torch.zeros(1, dtype=torch.int64)
        self._wait_all([self._send([torch.tensor([step], dtype=torch.int64)], peer, _SYNC_TAG),
                        self._recv([theirs], peer, _SYNC_TAG)])
        return int(theirs[0])

    def _meet(self, peer: int, peer_gen: int) -> tuple[str, int]:
        """Both sides say they have seen this pair of incarnations, on the key both name
        it by. The partner may take a new incarnation meanwhile (its own exchange broke
        later than ours): then we follow it to the new key instead of waiting out the
        timeout on the old one, which would only break the pair again."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        key = self._pair_key(peer, peer_gen)
        self._client.set(f"{key}/seen-{self.rank}", "1")
        read = time.monotonic()
        while not self._client.check([f"{key}/seen-{peer}"]):
            now = time.monotonic()
            if now >= deadline:
                raise RuntimeError(f"partner rank {peer}'s writer did not pair again within "
                                   f"{self.timeout.total_seconds():.0f} s")
            if now - read >= MEET_POLL_S:
                read = now
                gen = self._current_gen(peer, self._client.get(self._gen_key(peer)))
                if gen is None:
                    raise RuntimeError(f"partner rank {peer}'s writer is gone")
                if gen != peer_gen:
                    peer_gen, key = gen, self._pair_key(peer, gen)
                    self._client.set(f"{key}/seen-{self.rank}", "1")
            time.sleep(0.02)
        return key, peer_gen

    def _refresh_pairs(self, step: int) -> tuple[set[int], set[int]]:
        """Before each exchange: one store read says whether a partner's writer was started
        again (its incarnation changed); that pair is built again, on both sides, before
        any byte moves (O(replicas) keys, one round trip). Returns the partners to leave
        out of this step: a new writer that is already past it (its rank failed the step),
        and apart, those whose writer is gone for good (their ranks save nothing any more)."""
        partners = sorted(self._peer_gen)
        if not partners:
            return set(), set()
        values = self._client.multi_get([self._gen_key(p) for p in partners])
        skip, gone = set(), set()
        for peer, value in zip(partners, values):
            gen = self._current_gen(peer, value)
            if gen is None:  # that rank saves nothing any more: nothing to exchange with it
                self._pairs.pop(peer, None)
                gone.add(peer)
                continue
            if gen != self._peer_gen[peer] and peer in self._pairs:
                log.warning("incluster: rank %d: partner rank %d has a new writer; pairing again", self.rank, peer)
                del self._pairs[peer]
            if peer not in self._pairs:
                theirs = self._build(peer, gen, step)
                if theirs is not None and theirs > step:
                    skip.add(peer)
        return skip, gone

    def _send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        pg, other = self._pairs[peer]
        return _Work(pg.send(tensors, other, tag), peer)

    def _recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        pg, other = self._pairs[peer]
        return _Work(pg.recv(tensors, other, tag), peer)

    def _ring(self, owner: int) -> SlotRing:
        ring = self.rings.get(owner)
        if ring is None:
            ring = self.rings[owner] = SlotRing(rank_folder(self.local_dir, self.job, owner), self.keep)
        return ring

    def _tag(self, step: int, round_: int) -> int:
        return (step % (1 << 24)) * 4 + round_

    def _wait_all(self, works: list[Any]) -> None:
        for w in works:
            try:
                w.work.wait(self.timeout)
            except RuntimeError as exc:  # gloo names an address, never the rank: say which partner
                raise RuntimeError(f"with partner rank {w.peer}: {exc}") from exc

    def exchange(self, step: int, own: OwnShard | None, coord: Coordinator) -> list[int]:
        """Run one step's replication with every partner; returns the owners received."""
        try:
            skip, gone = self._refresh_pairs(step)
            if gone:
                coord.failed(step, f"rank {sorted(gone)}'s {PARTNER_GONE} (it kept dying, or its "
                                   f"Checkpointer failed to start): no step can be complete until the job restarts")
            elif skip:
                coord.failed(step, f"rank {sorted(skip)}'s writer {PARTNER_NEW}, or saved a later step, "
                                   f"before this one")
            return self._exchange(step, own, coord, skip | gone)
        except RuntimeError as exc:  # gloo (a timeout, a closed pair) or the store: the pairs are spent
            self._repair(exc)
            raise

    def _repair(self, why: BaseException) -> None:
        """A pair broke (a gloo timeout closes it for good, e.g. when ranks saved different
        steps): take a new incarnation, so that every partner builds its pair with this
        writer again, on a fresh prefix, at its next exchange - as after a writer restart."""
        self._pairs.clear()
        self.incarnation += REPAIR_STEP
        self._client.set(f"{self._gen_key(self.rank)}/{self.incarnation}/up", "1")
        self._client.set(self._gen_key(self.rank), str(self.incarnation))
        log.warning("incluster: rank %d: replication with its partners broke (%s); they pair again at the next "
                    "save", self.rank, str(why).splitlines()[0][:200])

    def _exchange(self, step: int, own: OwnShard | None, coord: Coordinator, skip: set[int]) -> list[int]:
        sources = [r for r in self.sources if r not in skip]
        targets = [r for r in self.targets if r not in skip]
        headers = {src: torch.zeros(4, dtype=torch.int64) for src in sources}
        mine = torch.tensor([step, len(own.sidecar), own.size, own.content] if own else [step, -1, -1, 0],
                            dtype=torch.int64)
        works = [self._recv([t], src, self._tag(step, 1)) for src, t in headers.items()]
        works += [self._send([mine], dst, self._tag(step, 1)) for dst in targets]
        self._wait_all(works)
        needs = {dst: torch.zeros(1, dtype=torch.int64) for dst in targets}
        answers = {src: torch.tensor([self._wants(src, step, h, own)], dtype=torch.int64) for src, h in headers.items()}
        works = [self._recv([t], dst, self._tag(step, 2)) for dst, t in needs.items()]
        works += [self._send([t], src, self._tag(step, 2)) for src, t in answers.items()]
        self._wait_all(works)
        refused = self._refused.pop(step, None)
        if refused is not None:
            coord.failed(step, refused)
        return self._data_round(step, own, headers, answers, needs, coord)

    def _wants(self, owner: int, step: int, header: torch.Tensor, own: OwnShard | None) -> int:
        """0: nothing; 1: the sidecar and the bytes; 2: the sidecar only (my own shard of
        this step holds the same bytes)."""
        h_step, sc_len, size, content = (int(x) for x in header)
        if h_step != step or sc_len < 0 or size < 0:
            return 0
        if sc_len > _MAX_SIDECAR:
            log.warning("incluster: rank %d sent a %d-byte sidecar for step %d; refused", owner, sc_len, step)
            return 0
        ring = self._ring(owner)
        ring.forget_unmarked()  # after a load() that went back: the abandoned steps' slots
        if not (step not in ring.committed_steps() and all(s.step is None or s.step < step for s in ring.slots)):
            return 0
        if self.share and own is not None and content != 0 and own.content == content and own.size == size:
            return 2
        room = _room(ring)
        if size > room:  # checked before anything is allocated: a bad header must not fill the RAM disk
            self._refused[step] = (f"rank {owner} announced a {size}-byte shard for step {step}, but rank "
                                   f"{self.rank}'s RAM disk has room for {room}")
            log.warning("incluster: %s; the replica is refused and the step fails", self._refused[step])
            return 0
        return 1

    def _data_round(self, step: int, own: OwnShard | None, headers: dict[int, torch.Tensor],
                    answers: dict[int, torch.Tensor], needs: dict[int, torch.Tensor], coord: Coordinator) -> list[int]:
        works: list[Any] = []
        incoming: list[tuple[int, Any, Any, torch.Tensor, int]] = []  # (src, ring, slot, sidecar, size)
        for src, header in headers.items():
            answer = int(answers[src][0])
            if not answer:
                continue
            sc_len, size = int(header[1]), int(header[2])
            if answer == 2:  # a shared replica: the sidecar alone
                sc_buf = torch.empty(sc_len, dtype=torch.uint8)
                works.append(self._recv([sc_buf], src, self._tag(step, 3)))
                incoming.append((src, None, None, sc_buf, size))
                continue
            ring = self._ring(src)
            slot = ring.acquire(step, self.timeout.total_seconds())
            buf = ring.prepare(slot, size)
            sc_buf = torch.empty(sc_len, dtype=torch.uint8)
            works.append(self._recv([sc_buf], src, self._tag(step, 3)))
            if size:
                works.append(self._recv([buf], src, self._tag(step, 3)))
            incoming.append((src, ring, slot, sc_buf, size))
        if own is not None:
            sc_t = torch.frombuffer(bytearray(own.sidecar), dtype=torch.uint8)
            data = torch.frombuffer(own.buf, dtype=torch.uint8, count=own.size) if own.size else None
            for dst, need in needs.items():
                if int(need[0]):
                    works.append(self._send([sc_t], dst, self._tag(step, 3)))
                    if data is not None and int(need[0]) == 1:
                        works.append(self._send([data], dst, self._tag(step, 3)))
        try:
            self._wait_all(works)
        except BaseException:
            for _, ring, slot, _, _ in incoming:
                if slot is not None:
                    ring.release(slot)
            raise
        received = []
        for src, ring, slot, sc_buf, size in incoming:
            try:
                if slot is None:
                    self._commit_shared(src, step, bytes(sc_buf.numpy()), size, own)
                else:
                    self._commit_replica(src, step, ring, slot, bytes(sc_buf.numpy()), size)
            except BaseException as exc:
                if slot is not None:
                    ring.release(slot)
                coord.failed(step, f"replica of rank {src} on rank {self.rank}: {exc}")
                raise
            coord.committed(step)
            received.append(src)
        return received

    def _commit_replica(self, owner: int, step: int, ring: SlotRing, slot: Any, raw: bytes, size: int) -> None:
        where = f"replica of rank {owner} step {step} (received by rank {self.rank})"
        sc = parse_received_sidecar(raw, where, rank=owner, step=step, job=self.job, size=size)
        commit_received(ring, slot, sc, where, replica_on=self.node)

    def _commit_shared(self, owner: int, step: int, raw: bytes, size: int, own: OwnShard | None) -> None:
        """The owner's sidecar, committed as a replica whose bytes are my own shard's."""
        import json

        from incluster.format.checksum import Checksum
        from incluster.format.sidecar import write_sidecar
        from incluster.staging.slots import sidecar_file

        where = f"shared replica of rank {owner} step {step} (on rank {self.rank})"
        sc = parse_received_sidecar(raw, where, rank=owner, step=step, job=self.job, size=size)
        record = json.loads(own.sidecar) if own is not None else {}
        mine = Checksum.from_json(record["checksum"], where) if own is not None else None
        if sc.checksum != mine:  # the digest of the records matched; the records must too
            raise CheckpointError(f"{where}: its checksums differ from rank {self.rank}'s own shard")
        # My own copy may itself be shared (after a restore moved me onto a node holding my
        # replica as another rank's bytes): the bytes are in that rank's file, never in a
        # file of mine that does not exist.
        holder = (record.get("extra") or {}).get("shared_with")
        holder = holder if type(holder) is int and holder >= 0 else self.rank
        extra = {**sc.extra, "replica_on": self.node, "shared_with": holder}
        ring = self._ring(owner)
        write_sidecar(os.path.join(ring.folder, sidecar_file(step)), dataclasses.replace(sc, extra=extra))

    def set_global(self, step: int) -> None:
        """``step`` committed everywhere: replica slots holding older steps may be reused."""
        for ring in self.rings.values():
            ring.set_global(step)
            ring.drop_unheld(step)

    def discard(self, step: int) -> None:
        """``step`` failed: un-commit every replica of it held here; their slots are free."""
        for ring in self.rings.values():
            ring.discard(step)

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
