"""Every query on a worker's hot path reads what it needs, never the backlog (issue 44).

A model with 60,000 queued batch lines: the statements a worker sends to claim lines (fairly, by
message or by count), renew leases, record results, poll cancels and sweep for stranded and
orphaned jobs are captured as they run, then each is run again under EXPLAIN ANALYZE: no plan may
scan the jobs table sequentially, and no plan may touch more than a few hundred of its rows. A
query that turns into a scan of the backlog fails here, on any machine, with its plan printed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import event, func, select, text

from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.job_store import JobResult, JobStore
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus

MODEL = "hot-model"
BACKLOG = 60_000
PROJECTS = 6
# Rows of `jobs` one statement may touch (returned or filtered out, over all loops): a claim of 32
# lines reads a few per project and per candidate; the backlog is 60,000.
MOST_ROWS_TOUCHED = 600


@pytest.fixture(scope="module")
def engine(pg_url):
    engine = make_sql_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (id, project, model, endpoint, prompt, params, status, work_class, priority, "
                "attempts, line_number, created_at) SELECT gen_random_uuid(), 'project-' || (i % :projects), "
                ":model, '/v1/completions', 'line', '{}', 'queued', 'batch', 0, 0, i, "
                "now() - interval '1 hour' + i * interval '1 millisecond' FROM generate_series(1, :count) AS i"
            ),
            {"projects": PROJECTS, "model": MODEL, "count": BACKLOG},
        )
        conn.execute(
            text(
                "INSERT INTO jobs (id, project, model, endpoint, prompt, params, status, work_class, priority, "
                "attempts, created_at) SELECT gen_random_uuid(), 'chat', :model, '/v1/chat/completions', 'hi', "
                "'{}', 'queued', 'interactive', 0, 0, now() - interval '2 hours' FROM generate_series(1, 3)"
            ),
            {"model": MODEL},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE jobs"))
    yield engine
    engine.dispose()


class Captured:
    """The statements (with their parameters) sent through `engine` while capturing."""

    def __init__(self, engine):
        self.engine = engine
        self.statements: list[tuple[str, object]] = []

    def __enter__(self) -> "Captured":
        event.listen(self.engine, "before_cursor_execute", self._note)
        return self

    def __exit__(self, *exc) -> None:
        event.remove(self.engine, "before_cursor_execute", self._note)

    def _note(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH", "DELETE", "INSERT")):
            self.statements.append((statement, parameters))


def _nodes(plan: dict) -> Iterator[dict]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _check_plans(engine, statements: list[tuple[str, object]]) -> list[int]:
    """EXPLAIN ANALYZE each statement (in a transaction rolled back); returns the rows each touched."""
    touched_per_statement = []
    raw = engine.raw_connection()
    try:
        for statement, parameters in statements:
            cursor = raw.cursor()
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters)
            [[plan]] = cursor.fetchone()
            raw.rollback()
            scans = [n for n in _nodes(plan["Plan"]) if n.get("Relation Name") == "jobs"]
            shown = f"{statement}\n{json.dumps(plan, indent=1)}"
            assert not any(n["Node Type"] == "Seq Scan" for n in scans), f"a scan of the backlog:\n{shown}"
            touched = sum(
                (n["Actual Rows"] + n.get("Rows Removed by Filter", 0) + n.get("Rows Removed by Index Recheck", 0))
                * n["Actual Loops"]
                for n in scans
            )
            assert touched <= MOST_ROWS_TOUCHED, f"{touched} rows of jobs touched:\n{shown}"
            touched_per_statement.append(touched)
    finally:
        raw.close()
    return touched_per_statement


def test_a_workers_hot_path_never_reads_the_backlog(engine):
    store = JobStore(make_session_factory(engine))
    worker = f"w-{uuid.uuid4().hex[:6]}"
    with store.sessions() as session:
        hint = list(session.scalars(select(Job.id).where(Job.model == MODEL).order_by(Job.line_number).limit(8)))
    with Captured(engine) as captured:
        by_count = store.claim_fair_count(MODEL, 32, worker, 30.0, 3)
        by_message = store.claim_fair(hint, worker, 30.0, 3, skip=set(by_count))
        claimed = [*by_count, *by_message]
        store.renew_leases(claimed, worker, 30.0)
        store.cancel_requested_among(claimed)
        store.finish_many(worker, [(job_id, JobResult(status=JobStatus.SUCCEEDED)) for job_id in claimed[:20]])
        store.release_many(claimed[20:24], worker)
        store.expired_running_jobs(work_class=WorkClass.BATCH)
        store.stale_queued_jobs(60.0, model=MODEL, work_class=WorkClass.INTERACTIVE)
        store.finish_orphaned_cancels()
    assert len(by_count) == 32 and len(by_message) == 8
    assert len(captured.statements) >= 10
    touched = _check_plans(engine, captured.statements)
    print("rows touched per statement:", touched)


def test_the_check_catches_a_query_that_reads_the_backlog(engine):
    # The control: the GROUP BY a fair claim made for each project's oldest line before it read them
    # by index touches every queued line, and the check says so.
    query = (
        select(Job.project, func.min(Job.created_at))
        .where(Job.model == MODEL, Job.work_class == WorkClass.BATCH, Job.status == JobStatus.QUEUED)
        .group_by(Job.project)
    )
    compiled = query.compile(engine)
    with pytest.raises(AssertionError, match="a scan of the backlog|rows of jobs touched"):
        _check_plans(engine, [(str(compiled), compiled.params)])
