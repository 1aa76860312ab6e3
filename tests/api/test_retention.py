"""Retention (store/retention.py, `tokenloom db prune`) on a real Postgres and Redis: exactly the
old finished jobs, batches and files go, with their stream keys; never an open job; counters stay."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
import redis
from sqlalchemy import select

from tokenloom.cli.main import main
from tokenloom.store import retention
from tokenloom.store.jobs import job_stats
from tokenloom.store.jobs.streams import stream_key
from tokenloom.store.models import Batch, BatchStatus, File, Job, JobStatus, utcnow

BROKER = "redis://127.0.0.1:6379/0"
RETENTION = timedelta(days=30)
OLD, NEW = utcnow() - timedelta(days=40), utcnow() - timedelta(days=1)


@pytest.fixture
def database(migrated_database):
    url, _, sessions = migrated_database
    return url, sessions


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(BROKER)
    yield client
    client.close()


def job(name: str, status: JobStatus, finished_at=None, batch_id=None) -> Job:
    done = status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
    return Job(
        id=uuid.uuid4(),
        custom_id=name,
        model="m",
        project="p",
        prompt="x",
        params={},
        status=status,
        batch_id=batch_id,
        created_at=(finished_at or NEW) - timedelta(minutes=1),
        finished_at=finished_at if done else None,
        prompt_tokens=10,
        completion_tokens=5,
        ttft_s=0.2 if status is JobStatus.SUCCEEDED else None,
    )


def file(name: str, created_at) -> File:
    return File(
        id=f"file-{name}-{uuid.uuid4().hex[:8]}",
        project="p",
        purpose="batch",
        filename=name,
        bytes=1,
        content=b"x",
        created_at=created_at,
    )


def batch(name: str, status: BatchStatus, ended_at, input_file: File) -> Batch:
    return Batch(
        id=uuid.uuid4(),
        project="p",
        status=status,
        input_file_id=input_file.id,
        metadata_={"name": name},
        completed_at=ended_at if status is BatchStatus.COMPLETED else None,
        cancelled_at=ended_at if status is BatchStatus.CANCELLED else None,
    )


def seed(sessions) -> None:
    """Every case once; names say which must go ("gone-") and which must stay ("kept-")."""
    files = {
        name: file(name, created)
        for name, created in [
            ("gone-unused", OLD),
            ("kept-new", NEW),
            ("gone-of-old-batch", OLD),
            ("kept-of-new-batch", OLD),
            ("kept-of-open-batch", OLD),
            ("kept-of-running-batch", OLD),
        ]
    }
    batches = {
        "gone-old-batch": batch("gone-old-batch", BatchStatus.COMPLETED, OLD, files["gone-of-old-batch"]),
        "kept-new-batch": batch("kept-new-batch", BatchStatus.COMPLETED, NEW, files["kept-of-new-batch"]),
        # cancelled long ago, but one job is still being cancelled on a worker
        "kept-open-batch": batch("kept-open-batch", BatchStatus.CANCELLED, OLD, files["kept-of-open-batch"]),
        "kept-running-batch": batch(
            "kept-running-batch", BatchStatus.IN_PROGRESS, None, files["kept-of-running-batch"]
        ),
    }
    jobs = [job(f"gone-{s.value}", s, OLD) for s in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)]
    jobs += [job(f"kept-new-{s.value}", s, NEW) for s in (JobStatus.SUCCEEDED, JobStatus.FAILED)]
    jobs += [job(f"kept-{s.value}", s, OLD) for s in (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLING)]
    jobs += [job(f"gone-in-old-batch-{i}", JobStatus.SUCCEEDED, OLD, batches["gone-old-batch"].id) for i in range(7)]
    jobs += [
        job("kept-in-new-batch", JobStatus.SUCCEEDED, OLD, batches["kept-new-batch"].id),
        job("kept-done-in-open-batch", JobStatus.CANCELLED, OLD, batches["kept-open-batch"].id),
        job("kept-cancelling-in-open-batch", JobStatus.CANCELLING, OLD, batches["kept-open-batch"].id),
        job("kept-done-in-running-batch", JobStatus.SUCCEEDED, OLD, batches["kept-running-batch"].id),
    ]
    with sessions.begin() as session:
        session.add_all(files.values())
        session.flush()
        session.add_all(batches.values())
        session.flush()
        session.add_all(jobs)


def names(sessions) -> tuple[set[str], set[str], set[str]]:
    with sessions() as session:
        return (
            set(session.execute(select(Job.custom_id)).scalars()),
            {b["name"] for b in session.execute(select(Batch.metadata_)).scalars()},
            {f for f in session.execute(select(File.filename)).scalars()},
        )


def test_prune_deletes_exactly_old_finished_rows_and_their_stream_keys(database, redis_client):
    _, sessions = database
    seed(sessions)
    with sessions() as session:
        all_jobs = {custom_id: job_id for custom_id, job_id in session.execute(select(Job.custom_id, Job.id))}
    for job_id in all_jobs.values():
        redis_client.xadd(stream_key(job_id), {"data": "{}"})
    tokens = job_stats.token_totals(sessions)
    hists = {c: job_stats.histograms(sessions, c) for c in job_stats.HISTOGRAM_BOUNDS}
    planned = retention.count_prunable(sessions, RETENTION)
    try:
        report = retention.prune(sessions, redis_client, RETENTION, batch_size=2)
        jobs_left, batches_left, files_left = names(sessions)
        assert jobs_left == {n for n in all_jobs if n.startswith("kept-")}
        assert batches_left == {"kept-new-batch", "kept-open-batch", "kept-running-batch"}
        assert files_left == {"kept-new", "kept-of-new-batch", "kept-of-open-batch", "kept-of-running-batch"}
        assert report == retention.PruneReport(jobs=10, batches=1, files=2, stream_keys=10)
        assert (planned.jobs, planned.batches, planned.files) == (report.jobs, report.batches, report.files)
        for name, job_id in all_jobs.items():
            assert redis_client.exists(stream_key(job_id)) == name.startswith("kept-")
        assert job_stats.token_totals(sessions) == tokens  # counters: a prune never lowers them
        assert {c: job_stats.histograms(sessions, c) for c in job_stats.HISTOGRAM_BOUNDS} == hists
        assert sum(job_stats.jobs_by_status(sessions).values()) == len(jobs_left)
        assert retention.prune(sessions, redis_client, RETENTION) == retention.PruneReport()
    finally:
        redis_client.delete(*(stream_key(job_id) for job_id in all_jobs.values()))


def test_prune_if_due_runs_once_per_interval_across_workers(database, redis_client):
    _, sessions = database
    seed(sessions)
    redis_client.delete(retention.PRUNE_LOCK_KEY)
    try:
        # Retention off: the pass still runs (expired files lose their bytes) but deletes nothing old.
        off = retention.prune_if_due(sessions, redis_client, 0)
        assert off is not None
        off.join(60)
        assert {n for n in names(sessions)[0] if n.startswith("gone-")}
        redis_client.delete(retention.PRUNE_LOCK_KEY)
        thread = retention.prune_if_due(sessions, redis_client, RETENTION.days)
        assert thread is not None
        thread.join(60)
        assert retention.prune_if_due(sessions, redis_client, RETENTION.days) is None  # another worker, same hour
        assert 0 < redis_client.ttl(retention.PRUNE_LOCK_KEY) <= retention.PRUNE_INTERVAL_S
        assert not {n for n in names(sessions)[0] if n.startswith("gone-")}
    finally:
        redis_client.delete(retention.PRUNE_LOCK_KEY)


def write_config(tmp_path, url: str, retention_days: float = 0) -> str:
    path = tmp_path / "config.toml"
    path.write_text(f'[database]\nurl = "{url}"\nretention_days = {retention_days}\n[queue]\nbroker_url = "{BROKER}"\n')
    return str(path)


def test_db_prune_refuses_without_a_retention_period(database, tmp_path, capsys):
    url, sessions = database
    seed(sessions)
    assert main(["db", "prune", "--config", write_config(tmp_path, url)]) == 2
    assert "--older-than-days" in capsys.readouterr().err
    assert {n for n in names(sessions)[0] if n.startswith("gone-")}


def test_db_prune_dry_run_counts_and_deletes_nothing(database, tmp_path, capsys):
    url, sessions = database
    seed(sessions)
    before = names(sessions)
    assert main(["db", "prune", "--dry-run", "--older-than-days", "30", "--config", write_config(tmp_path, url)]) == 0
    assert json.loads(capsys.readouterr().out) == {"jobs": 10, "batches": 1, "files": 2, "stream_keys": 10}
    assert names(sessions) == before


def test_db_prune_uses_the_configured_retention_days(database, tmp_path, capsys):
    url, sessions = database
    seed(sessions)
    assert main(["db", "prune", "--config", write_config(tmp_path, url, retention_days=30)]) == 0
    assert json.loads(capsys.readouterr().out)["batches"] == 1
    assert not {n for n in names(sessions)[0] if n.startswith("gone-")}
