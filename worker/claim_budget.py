"""How many jobs of each work class a worker may still claim: the claim budget.

A worker holds at most `max_in_flight` claimed jobs, so the rows it cannot start soon stay queued
for other workers. Interactive work has a budget of its own (the same limit again), so a chat
request never waits behind jobs or batch lines; jobs and batch lines share the other one, and a
batch line gets no room while a job waits for some, so a polled job goes before a batch line.

No class starves: each class of the shared window is guaranteed `min_share` of it
(`[queue] min_claim_share`, at least one job when above 0). A class holding less than its
guarantee gets room even while a better class waits (a batch line under steady /v1/jobs load),
and while it waits below its guarantee, the other class may not take the room it is owed.

Room is counted in two parts: jobs held (claimed, or being claimed, and not yet recorded) and room
reserved by a claim in flight, so two claims never count the same room twice. A claim reserves
room first (`reserve`), then exchanges the reservation for the jobs it took (`hold`); a job's room
comes back when it ends (`release`).

Plain arithmetic, no I/O and no threads: not thread-safe, the JobRunner calls it under its lock
and waits on its own condition for room.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence

from tokenloom.store.jobs.work_class import WorkClass  # the enum alone: a module with no I/O


class ClaimBudget:
    def __init__(self, max_in_flight: int, min_share: float = 0.0) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        if not 0.0 <= min_share <= 0.5:
            raise ValueError(f"min_share must be in [0, 0.5] (two classes share the window), not {min_share}")
        self.max_in_flight = max_in_flight
        # Jobs each class of the shared window is guaranteed: at least one when the share is above 0, and
        # never more than half the window (a window of one seat guarantees nothing: two classes would
        # each be owed the one seat and neither could take it).
        owed = 0 if min_share == 0 else max(1, math.floor(min_share * max_in_flight))
        self.guaranteed = min(owed, max_in_flight // 2)
        self._held: dict[uuid.UUID, WorkClass] = {}  # each held job and the class it was claimed as
        self._held_interactive = 0
        self._held_by_class: Counter[WorkClass] = Counter()
        self._reserved: Counter[WorkClass] = Counter()  # room promised to a claim in flight
        self._waiting: Counter[WorkClass] = Counter()  # claims waiting for room

    def room(self, work_class: WorkClass) -> int:
        """How many more jobs of this class may be reserved now (0 when none)."""
        if work_class is WorkClass.INTERACTIVE:
            used = self._held_interactive + self._reserved[WorkClass.INTERACTIVE]
            return max(0, self.max_in_flight - used)
        held = len(self._held) - self._held_interactive
        free = self.max_in_flight - held - self._reserved[WorkClass.JOBS] - self._reserved[WorkClass.BATCH]
        other = WorkClass.BATCH if work_class is WorkClass.JOBS else WorkClass.JOBS
        free -= self._owed(other) if self._waiting[other] else 0  # the waiting other class's guarantee
        if work_class is WorkClass.BATCH and self._waiting[WorkClass.JOBS]:
            free = min(free, self._owed(WorkClass.BATCH))  # a job waits: batch lines get only their guarantee
        return max(0, free)

    def owed(self, work_class: WorkClass) -> int:
        """How many more jobs of a shared-window class its guarantee still owes it (held and reserved count)."""
        return self._owed(work_class)

    def is_waiting(self, work_class: WorkClass) -> bool:
        """A claim of this class waits for room now."""
        return self._waiting[work_class] > 0

    def _owed(self, work_class: WorkClass) -> int:
        """How far a class of the shared window is below its guarantee (held and reserved)."""
        return max(0, self.guaranteed - self._held_by_class[work_class] - self._reserved[work_class])

    def reserve(self, work_class: WorkClass, wanted: int) -> int:
        """Reserve room for up to `wanted` jobs of this class; returns how many were reserved (0: no room)."""
        if wanted < 1:
            raise ValueError(f"a reservation is for at least one job, not {wanted}")
        taken = min(self.room(work_class), wanted)
        self._reserved[work_class] += taken
        return taken

    def first_unheld(self, candidates: Sequence[uuid.UUID], limit: int) -> tuple[list[uuid.UUID], int]:
        """Up to `limit` of the candidates not held already, in order, and how many candidates were looked at."""
        fresh: list[uuid.UUID] = []
        considered = 0
        for job_id in candidates:
            if len(fresh) == limit:
                break
            considered += 1
            if job_id not in self._held:
                fresh.append(job_id)
        return fresh, considered

    def hold(self, work_class: WorkClass, reserved: int, job_ids: Iterable[uuid.UUID]) -> None:
        """Exchange a reservation of `reserved` for these jobs (none, if the claim took none).

        A job held already keeps the class it was first held as: it is counted once.
        """
        if reserved > self._reserved[work_class]:
            raise ValueError(f"{reserved} {work_class.value} reserved returned, only {self._reserved[work_class]} held")
        self._reserved[work_class] -= reserved
        for job_id in job_ids:
            if job_id in self._held:
                continue
            self._held[job_id] = work_class
            self._held_by_class[work_class] += 1
            if work_class is WorkClass.INTERACTIVE:
                self._held_interactive += 1

    def release(self, job_id: uuid.UUID) -> None:
        """The job ended (or was never claimed): its room comes back. Unknown ids are ignored."""
        work_class = self._held.pop(job_id, None)
        if work_class is not None:
            self._held_by_class[work_class] -= 1
        if work_class is WorkClass.INTERACTIVE:
            self._held_interactive -= 1

    def wait_begins(self, work_class: WorkClass) -> None:
        """A claim of this class waits for room (a waiting job holds batch lines back)."""
        self._waiting[work_class] += 1

    def wait_ends(self, work_class: WorkClass) -> None:
        """That claim got its room, or gave up."""
        self._waiting[work_class] -= 1

    def holds(self, job_id: uuid.UUID) -> bool:
        return job_id in self._held

    def held_ids(self) -> list[uuid.UUID]:
        """A copy: the jobs held now."""
        return list(self._held)

    @property
    def held_count(self) -> int:
        return len(self._held)
