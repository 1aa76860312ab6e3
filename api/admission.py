"""Admission control, per class of work: a bound on each project's open (queued + running) jobs of
each limit's classes -> 429 + Retry-After.

It protects the queue from one tenant flooding it, without letting one class of a tenant's work
refuse another: a project's batch lines never make its chat requests answer 429.

| limit ([server]) | the classes it bounds (store/jobs/work_class.py) |
| --- | --- |
| `max_queued_jobs` | interactive and jobs: /v1/chat/completions, /v1/completions, /v1/jobs |
| `max_queued_batch_lines` | batch: Batch API lines, and requests sent with `service_tier: "flex"` |

A request is checked against the limits of the classes it adds jobs to, and only those. The counts
cost the same however many jobs a project has queued (store/jobs/job_stats.py's
`open_jobs_by_class`). The check and the insert are not one transaction, so concurrent requests
may overshoot a bound by a request's worth, which is fine for a back-pressure signal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from tokenloom.api.auth import Principal
from tokenloom.api.errors import ApiError
from tokenloom.api.state import ApiState
from tokenloom.settings.config import ServerConfig
from tokenloom.store.jobs import job_stats
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job

RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class ClassLimit:
    key: str  # the [server] key that sets it
    classes: frozenset[WorkClass]
    what: str  # what it counts, in its messages
    value: Callable[[ServerConfig], int]


CLASS_LIMITS = (
    ClassLimit(
        "max_queued_jobs",
        frozenset({WorkClass.INTERACTIVE, WorkClass.JOBS}),
        "jobs",
        lambda server: server.max_queued_jobs,
    ),
    ClassLimit(
        "max_queued_batch_lines",
        frozenset({WorkClass.BATCH}),
        "batch lines",
        lambda server: server.max_queued_batch_lines,
    ),
)


def admit(state: ApiState, caller: Principal, jobs: Iterable[Job]) -> None:
    """Admit new job rows (not yet inserted) by their classes: see `admit_counts`."""
    # A row built without a class gets the column's default, jobs.
    admit_counts(state, caller, Counter(job.work_class or WorkClass.JOBS for job in jobs))


def admit_batch_lines(state: ApiState, caller: Principal, num_lines: int) -> None:
    """Admit a batch's queued lines (every line of a batch is in the batch class)."""
    admit_counts(state, caller, {WorkClass.BATCH: num_lines})


def admit_counts(state: ApiState, caller: Principal, new_jobs: Mapping[WorkClass, int]) -> None:
    """Raise a 429 if the new jobs (how many of each class) would put the caller's project over the
    limit of their classes (a 400 if they alone exceed it: waiting would never help)."""
    checked = []
    for limit in CLASS_LIMITS:
        num_new = sum(new_jobs.get(work_class, 0) for work_class in limit.classes)
        bound = limit.value(state.config.server)
        if num_new == 0 or bound == 0:  # 0: no limit
            continue
        if num_new > bound:
            raise ApiError(
                400,
                f"{num_new:,} requests at once exceed the {bound:,} {limit.what} a project may have queued "
                f"or running ([server] {limit.key}): split them, or raise the limit",
                code="too_many_jobs",
            )
        checked.append((limit, num_new, bound))
    if not checked:
        return
    open_jobs = job_stats.open_jobs_by_class(state.sessions, caller.project)
    for limit, num_new, bound in checked:
        num_open = sum(open_jobs[work_class] for work_class in limit.classes)
        if num_open + num_new > bound:
            raise ApiError(
                429,
                f"project {caller.project!r} has {num_open:,} {limit.what} queued or running and the limit is "
                f"{bound:,} ([server] {limit.key}): retry after {RETRY_AFTER_S} s, or wait for some to finish",
                code="too_many_queued_jobs",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
