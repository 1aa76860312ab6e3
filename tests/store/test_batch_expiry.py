"""store/batches/batch_expiry.py on a real Postgres: a batch past its window fails its queued lines as
batch_expired at once, aborts its running ones, and finalizes `expired` with its done lines in the
output file and every other line in the error file, in OpenAI's shape; nothing else is touched."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from tests.store.batch_rows import add_batch
from tokenloom.store.batches import batch_expiry
from tokenloom.store.batches.batch_finalizer import finalize_if_done
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.files.file_chunks import read_chunks
from tokenloom.store.files.file_expiry import purge_expired_files
from tokenloom.store.files.file_queries import visible_file
from tokenloom.store.jobs.job_store import JobResult, JobStore
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Batch, BatchStatus, File, Job, JobErrorCode, JobStatus, utcnow


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_sql_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _batch(sessions, statuses: list[JobStatus], *, window_left_s: float, status=BatchStatus.IN_PROGRESS):
    expires_at = utcnow() + timedelta(seconds=window_left_s)
    return add_batch(sessions, statuses, status=status, expires_at=expires_at)[0]


def _lines(sessions, file_id: str) -> list[dict]:
    return [json.loads(line) for line in b"".join(read_chunks(sessions, file_id)).decode().splitlines()]


def test_an_expired_batch_keeps_what_it_did_and_reports_the_rest_as_batch_expired(sessions):
    states = [JobStatus.SUCCEEDED] * 3 + [JobStatus.RUNNING] * 2 + [JobStatus.QUEUED] * 5
    batch_id = _batch(sessions, states, window_left_s=-1)
    not_due = _batch(sessions, [JobStatus.QUEUED], window_left_s=3600)
    cancelling = _batch(sessions, [JobStatus.QUEUED], window_left_s=-1, status=BatchStatus.CANCELLING)
    due = batch_expiry.due_batches(sessions)
    assert batch_id in due and not_due not in due and cancelling not in due
    assert batch_expiry.expire_batch(sessions, batch_id) == (5, 2)
    assert batch_expiry.expire_batch(sessions, batch_id) == (0, 0)  # once
    with sessions() as session:
        jobs = session.scalars(select(Job).where(Job.batch_id == batch_id).order_by(Job.line_number)).all()
        assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * 3 + [JobStatus.CANCELLING] * 2 + [
            JobStatus.FAILED
        ] * 5
        assert all(j.error_code is JobErrorCode.BATCH_EXPIRED for j in jobs[5:])
        running = [j.id for j in jobs[3:5]]
    assert not finalize_if_done(sessions, batch_id)  # two lines are still being aborted
    # Their worker aborts them and records them cancelled, as it does for any cancel.
    JobStore(sessions).finish_many("w", [(job_id, JobResult(JobStatus.CANCELLED)) for job_id in running])
    assert finalize_if_done(sessions, batch_id)
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch.status is BatchStatus.EXPIRED and batch.expired_at is not None
        assert (batch.total, batch.completed, batch.failed) == (10, 3, 7)
        output, errors = batch.output_file_id, batch.error_file_id
        assert session.get(Batch, not_due).status is BatchStatus.IN_PROGRESS
    assert [line["custom_id"] for line in _lines(sessions, output)] == ["line-0", "line-1", "line-2"]
    expired = _lines(sessions, errors)
    assert [line["custom_id"] for line in expired] == [f"line-{i}" for i in range(3, 10)]
    assert all(line["response"] is None and line["error"]["code"] == "batch_expired" for line in expired)


def test_a_batch_with_nothing_running_expires_and_finalizes_at_once(sessions):
    batch_id = _batch(sessions, [JobStatus.QUEUED] * 4, window_left_s=-1)
    batch_expiry.expire_batch(sessions, batch_id)
    assert finalize_if_done(sessions, batch_id)
    with sessions() as session:
        assert session.get(Batch, batch_id).status is BatchStatus.EXPIRED


def test_output_files_expire_when_the_batch_asked_and_lose_their_bytes(sessions):
    batch_id = _batch(sessions, [JobStatus.SUCCEEDED, JobStatus.FAILED], window_left_s=3600)
    with sessions.begin() as session:
        session.get(Batch, batch_id).output_expires_after_s = 3600
    assert finalize_if_done(sessions, batch_id)
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        files = [session.get(File, file_id) for file_id in (batch.output_file_id, batch.error_file_id)]
    for row in files:
        assert row.expires_at - row.created_at == timedelta(seconds=3600)
        assert visible_file(sessions, row.id, None) is not None
    with sessions.begin() as session:  # an hour later
        session.execute(
            update(File).where(File.id.in_([f.id for f in files])).values(expires_at=utcnow() - timedelta(seconds=1))
        )
    assert all(visible_file(sessions, row.id, None) is None for row in files)  # a 404 from now on
    assert purge_expired_files(sessions) == 2
    assert purge_expired_files(sessions) == 0
    assert all(b"".join(read_chunks(sessions, row.id)) == b"" for row in files)
