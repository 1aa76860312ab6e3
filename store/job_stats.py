"""Aggregates over job rows for monitoring: counts by status, latency histograms, token totals,
and the timings of jobs that finished in a recent window.

The rows are the source of truth: every worker writes its jobs' timings there (ttft_s, tpot_s,
queue_s, as ARCHITECTURE.md defines them), so figures computed here cover all workers and
survive restarts. Each histogram is one aggregate query (one scan of the jobs with a value).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.models import Job, JobStatus, utcnow

TIMING_COLUMNS = {"ttft_s": Job.ttft_s, "tpot_s": Job.tpot_s, "queue_s": Job.queue_s}


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


def jobs_by_status(sessions: sessionmaker[Session]) -> dict[tuple[str, str], int]:
    """(model, status) -> number of jobs."""
    with sessions() as session:
        rows = session.execute(select(Job.model, Job.status, func.count()).group_by(Job.model, Job.status))
        return {(model, status.value): count for model, status, count in rows}


def token_totals(sessions: sessionmaker[Session]) -> dict[str, tuple[int, int]]:
    """model -> (prompt tokens, generated tokens) over all jobs that recorded them."""
    with sessions() as session:
        rows = session.execute(
            select(Job.model, func.coalesce(func.sum(Job.prompt_tokens), 0),
                   func.coalesce(func.sum(Job.completion_tokens), 0)).group_by(Job.model)
        )
        return {model: (int(prompt), int(completion)) for model, prompt, completion in rows}


def histograms(sessions: sessionmaker[Session], column: str, bounds: tuple[float, ...]) -> dict[str, Histogram]:
    """model -> cumulative histogram of one timing column (jobs where it is set)."""
    value = TIMING_COLUMNS[column]
    counts = [func.sum(case((value <= bound, 1), else_=0)) for bound in bounds]
    query = (select(Job.model, func.count(value), func.coalesce(func.sum(value), 0.0), *counts)
             .where(value.is_not(None)).group_by(Job.model))
    with sessions() as session:
        return {model: Histogram([int(c or 0) for c in bucket_counts], int(count), float(total))
                for model, count, total, *bucket_counts in session.execute(query)}


def window_timings(sessions: sessionmaker[Session], window_s: float, *, model: str | None = None,
                   project: str | None = None, now: datetime | None = None) -> dict[str, WindowTimings]:
    """model -> timings of the jobs that ended (succeeded or failed) within the last `window_s`."""
    since = (now or utcnow()) - timedelta(seconds=window_s)
    query = (select(Job.model, Job.status, Job.ttft_s, Job.tpot_s, Job.queue_s, Job.completion_tokens)
             .where(Job.finished_at >= since, Job.status.in_([JobStatus.SUCCEEDED, JobStatus.FAILED])))
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
