"""A project's open jobs per class of work (store/jobs/job_stats.py, what admission per class reads)
on a real Postgres: right with 100,000 queued batch lines of one project, and cheap: the rows it
counts are read through ix_jobs_fair_claim, never the backlog; and SQLite's fallback to the rows."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import delete, text
from sqlalchemy.dialects import postgresql

from tokenloom.store import migrate
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs import job_stats
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus

BACKLOG = 100_000


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_sql_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _insert(session, count: int, project: str, model: str, work_class: WorkClass, status: JobStatus) -> None:
    """`count` rows in one INSERT ... SELECT generate_series: 100,000 take a few seconds."""
    session.execute(
        text(
            "INSERT INTO jobs (id, project, model, endpoint, prompt, params, status, work_class, priority, "
            "attempts, created_at) SELECT gen_random_uuid(), :project, :model, '/v1/chat/completions', 'line', "
            "'{}', :status, :work_class, 0, 0, now() FROM generate_series(1, :count)"
        ),
        {"project": project, "model": model, "status": status.value, "work_class": work_class.value, "count": count},
    )


@pytest.fixture(scope="module")
def backlog(sessions):
    """Project `flood`: 100,000 queued batch lines on model-a, 3 queued chats on model-a and 2 running
    /v1/jobs on model-b (plus finished jobs, which are not open); project `calm`: a little of each."""
    with sessions.begin() as session:
        _insert(session, BACKLOG, "flood", "model-a", WorkClass.BATCH, JobStatus.QUEUED)
        _insert(session, 3, "flood", "model-a", WorkClass.INTERACTIVE, JobStatus.QUEUED)
        _insert(session, 2, "flood", "model-b", WorkClass.JOBS, JobStatus.RUNNING)
        _insert(session, 7, "flood", "model-b", WorkClass.JOBS, JobStatus.SUCCEEDED)
        _insert(session, 4, "calm", "model-a", WorkClass.BATCH, JobStatus.RUNNING)
        _insert(session, 1, "calm", "model-b", WorkClass.INTERACTIVE, JobStatus.QUEUED)
        session.execute(text("ANALYZE jobs"))
    yield
    with sessions.begin() as session:
        session.execute(delete(Job))


def test_open_jobs_are_counted_per_class_beside_a_huge_batch_backlog(sessions, backlog):
    assert job_stats.open_jobs_by_class(sessions, "flood") == {
        WorkClass.INTERACTIVE: 3,
        WorkClass.JOBS: 2,
        WorkClass.BATCH: BACKLOG,
    }
    assert job_stats.open_jobs_by_class(sessions, "calm") == {
        WorkClass.INTERACTIVE: 1,
        WorkClass.JOBS: 0,
        WorkClass.BATCH: 4,
    }
    assert job_stats.open_jobs_by_class(sessions, "nobody") == dict.fromkeys(WorkClass, 0)
    assert job_stats.open_jobs(sessions, "flood") == BACKLOG + 5  # every class: what the aggregates say


def test_the_row_count_reads_only_the_counted_classes_index_entries(sessions, backlog):
    query = job_stats.open_rows_query("flood", ["model-a", "model-b"], job_stats.ROW_COUNTED_CLASSES)
    sql = str(query.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    with sessions() as session:
        [plan] = session.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")).scalar_one()
    nodes = list(_nodes(plan["Plan"]))
    scans = [node for node in nodes if "Scan" in node["Node Type"]]
    # Whichever plan Postgres picks (an index scan, or a bitmap scan over the same index), it reads the
    # index and meets the 5 open chat and job rows, never the 100,000 batch lines beside them.
    assert scans and not any(node["Node Type"] == "Seq Scan" for node in scans), json.dumps(plan, indent=1)
    assert {node["Index Name"] for node in scans if "Index Name" in node} == {"ix_jobs_fair_claim"}, json.dumps(plan)
    touched = sum(node["Actual Rows"] + node.get("Rows Removed by Filter", 0) for node in scans)
    assert touched <= 50, json.dumps(plan, indent=1)


def test_models_with_queued_jobs_come_from_the_aggregates(sessions, backlog):
    assert job_stats.models_with_queued_jobs(sessions) == ["model-a", "model-b"]


def test_sqlite_counts_the_rows(sqlite_url):
    migrate.upgrade(sqlite_url)
    engine = make_sql_engine(sqlite_url)
    sqlite_sessions = make_session_factory(engine)
    with sqlite_sessions.begin() as session:
        for work_class, status in [
            (WorkClass.BATCH, JobStatus.QUEUED),
            (WorkClass.BATCH, JobStatus.RUNNING),
            (WorkClass.INTERACTIVE, JobStatus.QUEUED),
            (WorkClass.JOBS, JobStatus.SUCCEEDED),
        ]:
            session.add(Job(project="p", model="m", prompt="x", params={}, work_class=work_class, status=status))
    try:
        assert job_stats.open_jobs_by_class(sqlite_sessions, "p") == {
            WorkClass.INTERACTIVE: 1,
            WorkClass.JOBS: 0,
            WorkClass.BATCH: 2,
        }
        assert job_stats.models_with_queued_jobs(sqlite_sessions) == ["m"]
    finally:
        engine.dispose()


def _nodes(node: dict):
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)
