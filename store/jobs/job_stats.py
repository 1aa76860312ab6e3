"""Figures over all jobs for monitoring: counts by status, latency histograms, token totals,
open jobs per project and class (admission), and the timings of jobs that finished in a recent window.

The rows are the source of truth: every worker writes its jobs' timings there (ttft_s, tpot_s,
queue_s and e2e_s, as ARCHITECTURE.md defines them), so figures computed here cover all workers and
survive restarts. No call scans the jobs table, whatever its size:
- on Postgres, counts, tokens and histograms are sums of the trigger-kept deltas
  (store/jobs/job_aggregates.py): they cost the number of (model, project, status) keys, not of jobs;
- on SQLite (the offline ledger: one machine, small files) there are no triggers, and the same
  figures are aggregate queries over the rows;
- window_timings reads only the jobs finished in the window, through ix_jobs_finished_at.

Token totals and histograms are counters: on Postgres they keep counting jobs that retention
deleted (a Prometheus counter never goes down); status counts are the rows there now.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import ColumnElement, Select, case, func, select
from sqlalchemy.orm import QueryableAttribute, Session, sessionmaker

from tokenloom.store.jobs.job_aggregates import COUNT_DELTAS, HISTOGRAM_DELTAS, summed
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus, utcnow

# Bucket upper bounds of each timing histogram (seconds). Revisions 0004 (ttft_s, tpot_s, queue_s)
# and 0006 (e2e_s) store frozen copies in job_histogram_bounds; changing these needs a migration
# that rewrites that table.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
# vLLM's end-to-end buckets, extended past its 7,680 s: a batch job may wait in the queue for hours.
# fmt: off
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0, 14400.0, 43200.0, 86400.0,
)
# fmt: on
HISTOGRAM_BOUNDS = {"ttft_s": TTFT_BUCKETS, "tpot_s": TPOT_BUCKETS, "queue_s": QUEUE_BUCKETS, "e2e_s": E2E_BUCKETS}
TIMING_COLUMNS = {"ttft_s": Job.ttft_s, "tpot_s": Job.tpot_s, "queue_s": Job.queue_s, "e2e_s": Job.e2e_s}
OPEN_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING)
# The classes whose open jobs are counted row by row (open_jobs_by_class): admission keeps them few.
ROW_COUNTED_CLASSES = (WorkClass.INTERACTIVE, WorkClass.JOBS)


def sum_or_zero(column: QueryableAttribute[int | None]) -> ColumnElement[int]:
    """SUM(column), 0 where no row has a value. coalesce's stub types the result after its first argument
    (a nullable sum), so the cast says what the literal 0 guarantees: never NULL."""
    return cast("ColumnElement[int]", func.coalesce(func.sum(column), 0))


@dataclass(slots=True)
class Histogram:
    buckets: list[int]  # cumulative count of values <= each bound
    count: int = 0
    total: float = 0.0


@dataclass(slots=True)
class WindowTimings:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    succeeded: int = 0
    failed: int = 0
    output_tokens: int = 0


def has_aggregates(sessions: sessionmaker[Session]) -> bool:
    """Whether the database keeps the trigger-maintained aggregates (Postgres; not SQLite)."""
    return sessions.kw["bind"].dialect.name == "postgresql"


def jobs_by_status(sessions: sessionmaker[Session]) -> dict[tuple[str, str], int]:
    """(model, status) -> number of jobs."""
    if has_aggregates(sessions):
        found: dict[tuple[str, str], int] = defaultdict(int)
        for model, _project, status, num_jobs, _prompt, _completion in summed(sessions, COUNT_DELTAS):
            found[model, status] += int(num_jobs)
        return {key: n for key, n in found.items() if n}
    with sessions() as session:
        rows = session.execute(select(Job.model, Job.status, func.count()).group_by(Job.model, Job.status))
        return {(model, status.value): count for model, status, count in rows}


def token_totals(sessions: sessionmaker[Session]) -> dict[str, tuple[int, int]]:
    """model -> (prompt tokens, generated tokens) over all jobs that recorded them."""
    if has_aggregates(sessions):
        found: dict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))
        for model, _project, _status, _num_jobs, prompt, completion in summed(sessions, COUNT_DELTAS):
            found[model] = (found[model][0] + int(prompt), found[model][1] + int(completion))
        return dict(found)
    with sessions() as session:
        rows = session.execute(
            select(Job.model, sum_or_zero(Job.prompt_tokens), sum_or_zero(Job.completion_tokens)).group_by(Job.model)
        )
        return {model: (int(prompt), int(completion)) for model, prompt, completion in rows}


def open_jobs(sessions: sessionmaker[Session], project: str) -> int:
    """Queued + running jobs of a project (admission control)."""
    if has_aggregates(sessions):
        return sum(_open_jobs_per_model(sessions, project).values())
    with sessions() as session:
        return session.execute(
            select(func.count()).select_from(Job).where(Job.project == project, Job.status.in_(OPEN_STATUSES))
        ).scalar_one()


def open_jobs_by_class(sessions: sessionmaker[Session], project: str) -> dict[WorkClass, int]:
    """Queued + running jobs of a project per class of work (admission per class, api/admission.py).

    On Postgres no class is counted by scanning its backlog: the aggregates give the project's open
    jobs per model (they have no class); the classes of ROW_COUNTED_CLASSES, which admission keeps
    within [server] max_queued_jobs, are counted row by row through ix_jobs_fair_claim (one index
    range per model, holding only their rows: `open_rows_query`); the batch class, which may hold
    hundreds of thousands of queued lines, is the rest. The two reads are not one snapshot, so the
    batch figure may be off by the jobs that moved in between (never below 0): a back-pressure signal.
    """
    if not has_aggregates(sessions):
        with sessions() as session:
            rows = session.execute(
                select(Job.work_class, func.count())
                .where(Job.project == project, Job.status.in_(OPEN_STATUSES))
                .group_by(Job.work_class)
            ).all()
        return {work_class: 0 for work_class in WorkClass} | {work_class: int(n) for work_class, n in rows}
    per_model = _open_jobs_per_model(sessions, project)
    found = {work_class: 0 for work_class in WorkClass}
    models = [model for model, num_jobs in per_model.items() if num_jobs > 0]
    if models:
        with sessions() as session:
            for work_class, num_jobs in session.execute(open_rows_query(project, models, ROW_COUNTED_CLASSES)):
                found[work_class] = int(num_jobs)
    found[WorkClass.BATCH] = max(0, sum(per_model.values()) - sum(found[c] for c in ROW_COUNTED_CLASSES))
    return found


def _open_jobs_per_model(sessions: sessionmaker[Session], project: str) -> dict[str, int]:
    """model -> queued + running jobs of a project, from the aggregates (Postgres only)."""
    open_values = {status.value for status in OPEN_STATUSES}
    per_model: dict[str, int] = defaultdict(int)
    for model, row_project, status, num_jobs, _p, _c in summed(sessions, COUNT_DELTAS):
        if row_project == project and status in open_values:
            per_model[model] += int(num_jobs)
    return per_model


def open_rows_query(project: str, models: list[str], classes: Collection[WorkClass]) -> Select[WorkClass, int]:
    """(class, open jobs) of a project's rows of `classes` in `models`: every condition is on a key
    column of ix_jobs_fair_claim (model, work_class, status, project), so Postgres reads only the
    index entries of those rows (an index-only scan), however many of the project's other rows there are."""
    return (
        select(Job.work_class, func.count())
        .where(
            Job.model.in_(models),
            Job.work_class.in_(list(classes)),
            Job.status.in_(OPEN_STATUSES),
            Job.project == project,
        )
        .group_by(Job.work_class)
    )


def models_with_queued_jobs(sessions: sessionmaker[Session]) -> list[str]:
    """The models that have queued jobs (from the aggregates on Postgres: no scan of the queued rows)."""
    return sorted(
        {model for (model, status), n in jobs_by_status(sessions).items() if status == JobStatus.QUEUED.value and n > 0}
    )


def histograms(sessions: sessionmaker[Session], column: str) -> dict[tuple[str, str], Histogram]:
    """(model, work class) -> cumulative histogram of one timing column over HISTOGRAM_BOUNDS[column]
    (jobs where it is set). The class is "" for jobs that finished before classes were recorded."""
    bounds = HISTOGRAM_BOUNDS[column]
    if not has_aggregates(sessions):
        return _histograms_from_rows(sessions, column, bounds)
    per_bucket: dict[tuple[str, str], list[tuple[float, int, float]]] = defaultdict(list)
    for model, work_class, metric, le, num_values, value_sum in summed(sessions, HISTOGRAM_DELTAS):
        if metric == column and num_values:
            per_bucket[model, work_class].append((le, int(num_values), float(value_sum)))
    found = {}
    for key, buckets in per_bucket.items():
        # Stored bounds are these bounds plus Infinity, so each bound is the edge of a stored bucket.
        below = [sum(n for le, n, _ in buckets if le <= bound) for bound in bounds]
        found[key] = Histogram(below, sum(n for _, n, _ in buckets), sum(total for _, _, total in buckets))
    return found


def _histograms_from_rows(
    sessions: sessionmaker[Session], column: str, bounds: tuple[float, ...]
) -> dict[tuple[str, str], Histogram]:
    value = TIMING_COLUMNS[column]
    counts = [func.sum(case((value <= bound, 1), else_=0)) for bound in bounds]
    query = (
        select(Job.model, Job.work_class, func.count(value), func.coalesce(func.sum(value), 0.0), *counts)
        .where(value.is_not(None))
        .group_by(Job.model, Job.work_class)
    )
    with sessions() as session:
        return {
            (model, work_class.value): Histogram([int(c or 0) for c in bucket_counts], int(count), float(total))
            for model, work_class, count, total, *bucket_counts in session.execute(query)
        }


def window_timings(
    sessions: sessionmaker[Session],
    window_s: float,
    *,
    model: str | None = None,
    project: str | None = None,
    now: datetime | None = None,
) -> dict[str, WindowTimings]:
    """model -> timings of the jobs that ended (succeeded or failed) within the last `window_s`.
    Reads only the window's rows (ix_jobs_finished_at): its cost is the window's jobs, not the table's."""
    since = (now or utcnow()) - timedelta(seconds=window_s)
    query = select(Job.model, Job.status, Job.ttft_s, Job.tpot_s, Job.queue_s, Job.completion_tokens).where(
        Job.finished_at >= since, Job.status.in_([JobStatus.SUCCEEDED, JobStatus.FAILED])
    )
    if model is not None:
        query = query.where(Job.model == model)
    if project is not None:
        query = query.where(Job.project == project)
    found: dict[str, WindowTimings] = defaultdict(WindowTimings)
    with sessions() as session:
        for row_model, status, ttft, tpot, queue, tokens in session.execute(query):
            timings = found[row_model]
            if status is JobStatus.FAILED:
                timings.failed += 1
                continue
            timings.succeeded += 1
            timings.output_tokens += tokens or 0
            for name, value in (("ttft_s", ttft), ("tpot_s", tpot), ("queue_s", queue)):
                if value is not None:
                    getattr(timings, name).append(value)
    return dict(found)
