"""Guaranteed seats: no seat class that has work starves, whatever better classes keep arriving.

Priority alone lets a steady stream of better requests (chat) hold every one of `max_num_seqs`
seats forever, so a worse class (a batch) never runs. Each sequence therefore carries a seat
class (the caller's class of work), and every class with pending work is owed `guaranteed` seats:

- **admission**: while a class holds fewer running seats than it is owed and has a pending
  sequence, that sequence is admitted before any better-priority one (into a seat that frees up:
  the guarantee never preempts a running sequence to get in);
- **preemption**: a better-priority sequence may preempt a running one of another class only while
  that class holds more seats than it is owed.

Within a class and above the guarantee, priority rules as before. Plain Python: the scheduler
reports every move of a sequence in and out of its queues, this module counts.
"""

from __future__ import annotations

import math
from collections import Counter

from tokenloom.engine.core.sequence import Sequence


def guaranteed_seats(max_num_seqs: int, min_seat_share: float) -> int:
    """Seats owed to each class with work: the share of `max_num_seqs`, at least one when the share is
    above 0, at most half (two classes must fit)."""
    if min_seat_share <= 0:
        return 0
    return max(1, min(max_num_seqs // 2, math.floor(min_seat_share * max_num_seqs)))


class SeatShare:
    """Running and pending sequences per seat class, and what the guarantee allows."""

    def __init__(self, guaranteed: int):
        self.guaranteed = guaranteed
        self.num_running: Counter[int] = Counter()
        self.num_pending: Counter[int] = Counter()  # waiting or swapped

    def pending_added(self, seq: Sequence) -> None:
        self.num_pending[seq.seat_class] += 1

    def pending_removed(self, seq: Sequence) -> None:
        self.num_pending[seq.seat_class] -= 1

    def running_added(self, seq: Sequence) -> None:
        self.num_running[seq.seat_class] += 1

    def running_removed(self, seq: Sequence) -> None:
        self.num_running[seq.seat_class] -= 1

    def starved_classes(self) -> set[int]:
        """Classes with a pending sequence that hold fewer running seats than they are owed."""
        if not self.guaranteed:
            return set()
        return {c for c, n in self.num_pending.items() if n > 0 and self.num_running[c] < self.guaranteed}

    def preemptible(self, victims: list[Sequence], for_class: int) -> list[Sequence]:
        """`victims` (in order) less those a sequence of `for_class` may not preempt: each other class
        keeps its guaranteed seats."""
        if not self.guaranteed:
            return victims
        spare = {c: n - self.guaranteed for c, n in self.num_running.items() if c != for_class}
        allowed = []
        for victim in victims:
            if victim.seat_class == for_class:
                allowed.append(victim)
            elif spare.get(victim.seat_class, 0) > 0:
                spare[victim.seat_class] -= 1
                allowed.append(victim)
        return allowed
