"""A batch's request counts and usage from trigger-kept deltas (store/batches/batch_counters.py, revision
0011) on a real Postgres: equal to the sums over its lines through claims, results, retries, cancels
and deletes, folded by readers without changing a figure, read without touching the batch's lines,
and for batches made before the migration (no backfill), counted from their rows."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import delete, func, select, text, update

from tests.services import fresh_pg_database
from tests.store.batch_rows import add_batch
from tokenloom.store import migrate
from tokenloom.store.batches import batch_counters
from tokenloom.store.batches.batch_queries import _summed_rows, batch_counts
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.job_store import JobResult, JobStore
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Batch, Job, JobErrorCode, JobStatus, batch_count_deltas


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_sql_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _batch(sessions, lines: int, model: str = "counted-model") -> tuple[uuid.UUID, list[uuid.UUID]]:
    return add_batch(sessions, [JobStatus.QUEUED] * lines, model=model)


def _nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _by_rows(sessions, batch_id):
    return sorted(_summed_rows(sessions, [batch_id]))


def _by_deltas(sessions, batch_id):
    return sorted(batch_counters.summed_batch_deltas(sessions, [batch_id]))


def test_counts_follow_the_lines_through_a_batchs_life(sessions):
    batch_id, ids = _batch(sessions, 40)
    other, _ = _batch(sessions, 5)  # another batch's lines never mix in
    store = JobStore(sessions)
    assert batch_counts(sessions, [batch_id])[batch_id].total == 40
    claims = store.claim_many(ids[:30], "w1", 30.0, 3)
    assert len(claims) == 30
    assert _by_deltas(sessions, batch_id) == _by_rows(sessions, batch_id)
    done = [(job_id, JobResult(JobStatus.SUCCEEDED, prompt_tokens=7, completion_tokens=3)) for job_id in ids[:20]]
    store.finish_many("w1", done)
    store.finish_many("w1", [(ids[20], JobResult.failed(JobErrorCode.INVALID_REQUEST, "bad line"))])
    store.release_many(ids[21:25], "w1")  # a graceful shutdown hands lines back
    store.request_cancel(ids[25:28])
    store.renew_leases(ids[28:30], "w1", 30.0)  # changes no count: adds no delta
    assert _by_deltas(sessions, batch_id) == _by_rows(sessions, batch_id)
    counts = batch_counts(sessions, [batch_id, other])
    assert (counts[batch_id].total, counts[batch_id].completed, counts[batch_id].failed) == (40, 20, 1)
    assert (counts[batch_id].input_tokens, counts[batch_id].output_tokens) == (140, 60)
    assert counts[other].total == 5 and counts[other].completed == 0
    with sessions.begin() as session:  # retention deletes lines: their figures go with them
        session.execute(delete(Job).where(Job.id.in_(ids[:5])))
    assert _by_deltas(sessions, batch_id) == _by_rows(sessions, batch_id)
    assert batch_counts(sessions, [batch_id])[batch_id].input_tokens == 105


def test_a_reader_folds_many_deltas_into_one_per_status_and_no_figure_moves(sessions):
    batch_id, ids = _batch(sessions, 300)
    store = JobStore(sessions)
    for job_id in ids:  # one statement per line: one delta each
        store.claim_many([job_id], "w2", 30.0, 3)
        store.finish_many("w2", [(job_id, JobResult(JobStatus.SUCCEEDED, prompt_tokens=2, completion_tokens=1))])
    before = _by_rows(sessions, batch_id)
    assert _by_deltas(sessions, batch_id) == before  # this read folds them
    with sessions() as session:
        left = session.execute(
            select(func.count()).select_from(batch_count_deltas).where(batch_count_deltas.c.batch_id == batch_id)
        ).scalar_one()
    assert left <= 2  # one per status still holding lines (succeeded), or a zero-sum key dropped
    assert _by_deltas(sessions, batch_id) == before


def test_reading_a_batchs_counts_never_touches_its_lines(sessions):
    batch_id, _ = _batch(sessions, 2000)
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.batch_id == batch_id).values(status=JobStatus.SUCCEEDED))
    columns = batch_count_deltas.c
    query = (
        select(columns.batch_id, columns.status, func.sum(columns.num_jobs))
        .where(columns.batch_id == batch_id)
        .group_by(columns.batch_id, columns.status)
    )
    compiled = query.compile(sessions.kw["bind"])
    with sessions() as session:
        raw = session.connection().connection.cursor()
        raw.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + str(compiled), compiled.params)
        [[plan]] = raw.fetchone()
    shown = json.dumps(plan)
    assert '"Relation Name": "jobs"' not in shown
    # A few deltas (the INSERTs of 2,000 queued lines; the UPDATE's -2,000 queued and +2,000 succeeded).
    scans = [node for node in _nodes(plan["Plan"]) if node.get("Relation Name") == "batch_count_deltas"]
    assert scans and sum(node["Actual Rows"] for node in scans) <= 5, shown


def test_batches_made_before_the_migration_are_counted_from_their_rows():
    with fresh_pg_database() as url:
        migrate.upgrade(url, "0010")
        engine = make_sql_engine(url)
        batch_id = uuid.uuid4()
        with engine.begin() as conn:  # rows as revision 0010's schema holds them (no ORM: it is newer)
            conn.execute(
                text(
                    "INSERT INTO batches (id, project, endpoint, completion_window, status, total, completed, "
                    "failed, created_at) VALUES (:id, 'p', '/v1/completions', '24h', 'in_progress', 6, 0, 0, now())"
                ),
                {"id": batch_id},
            )
            conn.execute(
                text(
                    "INSERT INTO jobs (id, batch_id, project, model, endpoint, prompt, params, status, work_class, "
                    "priority, attempts, created_at, prompt_tokens) SELECT gen_random_uuid(), :id, 'p', 'm', "
                    "'/v1/completions', 'x', '{}', CASE WHEN i <= 4 THEN 'succeeded' ELSE 'queued' END, 'batch', "
                    "0, 0, now(), CASE WHEN i <= 4 THEN 5 END FROM generate_series(1, 6) AS i"
                ),
                {"id": batch_id},
            )
        migrate.upgrade(url)
        sessions = make_session_factory(engine)
        counts = batch_counts(sessions, [batch_id])[batch_id]
        assert (counts.total, counts.completed, counts.input_tokens) == (6, 4, 20)
        with sessions() as session:
            assert not session.get(Batch, batch_id).counted_by_triggers
        with sessions.begin() as session:  # a line that changes after the migration still counts
            session.execute(
                update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED).values(status="failed")
            )
        counts = batch_counts(sessions, [batch_id])[batch_id]
        assert (counts.total, counts.completed, counts.failed) == (6, 4, 2)
        new_id, _ = _batch(sessions, 3)  # a batch made after it is counted by the triggers
        with sessions() as session:
            assert session.get(Batch, new_id).counted_by_triggers
        assert batch_counts(sessions, [new_id, batch_id])[new_id].total == 3
        engine.dispose()
