"""Fair-share ranks of batch lines in the engine: tenants interleave, whoever came first.

The fair claim (store/jobs/fair_claim.py) decides which project's lines a worker takes; this
decides in which order the engine admits the lines it holds. Among equal priorities the engine
admits by `share_rank` before arrival, and each line gets one rank, like a start tag of
start-time fair queuing: a project's lines get consecutive ranks, and a project that starts
holding lines again starts at the worker's current "virtual time": the smallest rank among the lines
it holds that the engine has not admitted yet (`admitted`), or the last rank it gave if none
waits. So a tenant whose batch arrives while another's lines wait in the engine goes level with
the first of those waiting lines, then they alternate; a tenant that had a large batch yesterday
has no debt and no credit today. Lines already admitted do not hold the clock back: one long line
running for minutes would otherwise keep the virtual time at its rank while its project's later
lines are ranked thousands ahead, and a tenant arriving then would jump all of them. (A line the
engine preempts after admitting it stays counted as admitted: the clock never moves backwards.)

Not thread-safe: the JobRunner calls it under its lock.
"""

from __future__ import annotations

import uuid
from collections import Counter


class FairShareRanks:
    def __init__(self) -> None:
        self._rank_of: dict[uuid.UUID, int] = {}  # held lines
        self._waiting: dict[uuid.UUID, int] = {}  # held lines the engine has not admitted yet: the clock
        self._project_of: dict[uuid.UUID, str] = {}
        self._held: Counter[str] = Counter()
        self._next: dict[str, int] = {}  # the next rank of each project seen
        self._last_given = 0

    def rank(self, job_id: uuid.UUID, project: str) -> int:
        """The rank of a line this worker starts holding."""
        if not self._held[project]:
            virtual_time = min(self._waiting.values(), default=self._last_given)
            self._next[project] = max(self._next.get(project, 0), virtual_time)
        rank = self._next[project]
        self._next[project] = rank + 1
        self._rank_of[job_id] = rank
        self._waiting[job_id] = rank
        self._project_of[job_id] = project
        self._held[project] += 1
        self._last_given = rank
        return rank

    def admitted(self, job_id: uuid.UUID) -> None:
        """The engine started running the line: it no longer holds the clock back. Unknown ids are ignored."""
        self._waiting.pop(job_id, None)

    def release(self, job_id: uuid.UUID) -> None:
        """The line ended (or was handed back); unknown ids are ignored."""
        project = self._project_of.pop(job_id, None)
        if project is None:
            return
        del self._rank_of[job_id]
        self._waiting.pop(job_id, None)
        self._held[project] -= 1
        if not self._held[project]:
            del self._held[project]
