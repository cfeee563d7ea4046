"""Every rank must save the same steps: find out at once when one does not.

A rank that skips a save (``if loss < x: save()`` on some ranks only) or saves one step
more than the others leaves a step that can never be complete: without this, every other
rank waited ``slot_timeout_s`` for it (its ring full of that step, the next ``save()``
blocked too) and then blamed a crashed peer.

The job store holds, for each step P, the step that came next: ``n/T/P`` (T: how many
times the ranks called ``load()``, so a step number saved again after a load starts a new
sequence), set by the first rank to get there (compare-and-set, one round trip per save
per rank). A rank that saved P and then N reads the winner W of ``n/T/P``:

- W == N: the ranks agree;
- W < N: the others saved W, this rank did not. W fails for every rank, this rank takes
  part in W's replica exchange with nothing to send (its partners must not wait for it),
  and the walk goes on from W (the others may have saved more steps between);
- W > N: the others went from P straight to W; this rank's N fails, its exchange is left
  out (no partner of the other camp takes part in it), and the next save is checked
  against P again.

Any step a verdict fails is one that some rank did not save, so it could never have
committed: no verdict here fails a step that every rank saved. The writer sees its steps
in the order the trainer called ``save()`` (a refused save's failure is sent behind the
staging of the saves before it); a step not newer than the last one checked gets no
verdict. A writer started again (after its predecessor died) starts from the trainer's
previous step.

The sequence also numbers the saves for ``persistent_every`` (every Nth save goes to the
persistent tier): counting one rank's save() calls would leave the ranks counting apart
for good after one mismatch, each uploading other steps, and no step would ever be whole
in the tier. The winner's value carries its number and rank (``"N:number:rank"``), so
every rank that reads it takes the same number, a writer started again included, and a
rank whose step the others skipped names the rank that did.
"""

from __future__ import annotations

import logging
from typing import Callable

from incluster.errors import CommitError

log = logging.getLogger("incluster")

SAME_STEPS = "every rank must save the same steps"  # in every verdict here (saving.py tells them by it)
NO_MORE = "saves no more"  # ... or this, where the rank that did not save the step had left

_MAX_WALK = 64  # steps the others may have saved that this rank skipped, checked per save

# (timeline, prev, step, number) -> the (step, number, rank) recorded after prev (the first
# rank to get there wins; rank -1: not known); step CLOSED / EXITED: the rank that got there
# first closed its Checkpointer after prev, or exited without close() (number: its rank)
Successor = Callable[[int, int, int, int], tuple[int, int, int]]
CLOSED, EXITED = -1, -2


class SkippedByOthers(CommitError):
    """This rank's step is one the other ranks did not save."""


class SaveSequence:
    """This rank's place in the job's sequence of saves (the writer's commit thread only)."""

    def __init__(self, rank: int, successor: Successor, fail: Callable[[int, str], object],
                 skipped: Callable[[int, int], None]) -> None:
        self.rank = rank
        self._successor = successor
        self._fail = fail  # publish a step's failure for every rank
        self._skipped = skipped  # (step, timeline): take part in its exchange with nothing to send
        self.timeline = 0  # load() calls the trainer made before the steps checked
        self.pos: int | None = None  # the newest step this rank saved that the others saved too
        self.ordinal = 0  # pos's number in the sequence (0: the first save of the timeline)
        self._last: tuple[int, SkippedByOthers | None] | None = None  # the last step checked, its verdict

    def check(self, step: int, prev: int, ordinal: int, timeline: int = 0) -> bool:
        """Before ``step`` is committed (or published failed): raise SkippedByOthers if the
        others did not save it; fail the steps they saved that this rank skipped. False:
        no verdict (a step not newer than the last one checked). ``prev``, ``ordinal``:
        the trainer's previous save() step (-1: none) and its count of save() calls before
        this one, for a writer's first step. Afterwards ``ordinal`` is the step's number.
        Checking a step again gives the same verdict."""
        if timeline != self.timeline:  # load() ran: a new sequence (its first prev is -1)
            self.timeline, self.pos, self._last = timeline, None, None
        if self._last is not None and self._last[0] == step:
            if self._last[1] is not None:
                raise self._last[1]
            return True
        if self.pos is None:
            self.pos, self.ordinal = prev, ordinal - 1
        elif step <= self.pos:
            log.warning("incluster: rank %d: step %d reached its writer after step %d; not checked against the "
                        "other ranks' saves", self.rank, step, self.pos)
            return False
        try:
            self._walk(step)
        except SkippedByOthers as exc:
            self._last = (step, exc)
            raise
        self._last = (step, None)
        return True

    def _walk(self, step: int) -> None:
        assert self.pos is not None
        for _ in range(_MAX_WALK):
            won, number, by = self._successor(self.timeline, self.pos, step, self.ordinal + 1)
            if won in (CLOSED, EXITED):
                raise SkippedByOthers(f"{_gone(number, won, self.pos)}: step {step} is not saved by every rank")
            if won == step or won <= self.pos:
                self.pos, self.ordinal = step, number
                return
            if won > step:
                who = f"rank {by}" if by >= 0 else "another rank"
                raise SkippedByOthers(
                    f"{self._after()} {who} saved step {won}, not step {step}: rank {self.rank} saved step {step}, "
                    f"which {who} (and maybe others) did not save ({SAME_STEPS})")
            why = (f"rank {self.rank} did not save step {won}: {self._after()} it saved step {step} "
                   f"({SAME_STEPS})")
            log.error("incluster: %s", why)
            self._fail(won, why)
            self._skipped(won, self.timeline)
            self.pos, self.ordinal = won, number
        self.pos, self.ordinal = step, self.ordinal + 1  # a long run of skipped steps: the rest time out

    def close(self) -> None:
        """This rank saves no more: a step the others saved after its last one fails now,
        and one they save later fails at once (no partner waits for this rank)."""
        if self.pos is None:
            return
        leave(self._successor, self._fail, self.rank, self.timeline, self.pos, CLOSED)

    def _after(self) -> str:
        return "as its first save," if self.pos is None or self.pos < 0 else f"after step {self.pos},"


def leave(successor: Successor, fail: Callable[[int, str], object], rank: int, timeline: int, pos: int,
          how: int) -> None:
    """Mark in the job store that ``rank`` saves no more after step ``pos`` (-1: no save
    since ``timeline`` began), because it closed its Checkpointer (``how`` CLOSED) or
    exits without close() (EXITED): a step the others saved after it fails now, and one
    they save later fails at once."""
    won, _, _ = successor(timeline, pos, how, rank)
    if won > pos:  # a step the others saved after it (not CLOSED or EXITED, both < -1 < pos)
        why = f"{_gone(rank, how, pos)}: step {won} is not saved by every rank"
        log.error("incluster: %s", why)
        fail(won, why)


def _gone(rank: int, how: int, pos: int) -> str:
    what = "closed its Checkpointer" if how == CLOSED else "exited without close() (its training code raised?)"
    since = f"after step {pos}" if pos >= 0 else "without saving a step since it started or since its last load()"
    return f"rank {rank} {what} {since} and {NO_MORE}"
