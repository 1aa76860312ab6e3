"""Which running sequences make way for a more important waiting or swapped one.

A pending sequence whose priority is strictly better (lower) than the worst running one's may
take the place of running sequences of strictly worse priority, worst first, when `max_num_seqs`
or the KV pool keeps it out. (The token budget is no reason to preempt: the scheduler defers a
worse sequence's chunk to the next step instead, which costs nothing.) Equal priorities never preempt each other:
first come first served among equals is untouched, and two sequences can never take turns
evicting each other (a victim is always worse than the sequence it made way for, and goes back
with its sort key unchanged). Plain Python: the scheduler supplies the numbers, this module counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tokenloom.engine.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Room:
    """What the pending sequence finds in this step without preempting anything."""

    num_free_seats: int  # max_num_seqs minus the running sequences
    num_free_blocks: int
    budget: int  # tokens left in the step's budget


@dataclass(frozen=True, slots=True)
class Victim:
    """A running sequence that could be preempted, and what preempting it gives back."""

    seq: Sequence
    num_released_blocks: int  # blocks no other sequence shares, back in the pool once it goes
    num_planned_tokens: int  # its chunk in this step's plan (0 if none), back in the budget


def lower_priority_tail(running: list[Sequence], seq: Sequence) -> list[Sequence]:
    """The running sequences of strictly worse priority than `seq`, worst first.

    `running` is sorted by sort key, so they form its tail; preempting from the end keeps the
    most important running sequences and never touches one as important as `seq`.
    """
    tail: list[Sequence] = []
    for candidate in reversed(running):
        if candidate.priority <= seq.priority:
            break
        tail.append(candidate)
    return tail


def num_victims_needed(room: Room, victims: list[Victim], blocks_to_admit: Callable[[int], int]) -> int | None:
    """The fewest of `victims` (taken in order) whose preemption lets the pending sequence in.

    It needs a seat, some budget (the scheduler has made sure of that) and `blocks_to_admit(budget)`
    free blocks for its chunk, which grows with the budget that victims give back. None when all
    of them are not enough: then nothing is preempted, since it would not get in anyway.
    """
    seats, blocks, budget = room.num_free_seats, room.num_free_blocks, room.budget
    for count in range(len(victims) + 1):
        if count:
            victim = victims[count - 1]
            seats += 1
            blocks += victim.num_released_blocks
            budget += victim.num_planned_tokens
        if seats > 0 and budget > 0 and blocks_to_admit(budget) <= blocks:
            return count
    return None
