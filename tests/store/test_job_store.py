"""JobStore transitions against a real Postgres (and SQLite): every conditional UPDATE names the
states it may leave, so stale attempts never overwrite a finished row."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import delete, update

from tokenloom.store import migrate
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.job_store import ClaimOutcome, JobResult, JobStore
from tokenloom.store.models import TERMINAL_JOB_STATUSES, Job, JobStatus, utcnow

LEASE_S = 60.0


@pytest.fixture(scope="module")
def _sqlite_module_url(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('jobstore') / 'tokenloom.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def _sessions(request):
    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "_sqlite_module_url")
    engine = make_sql_engine(url)
    yield make_session_factory(engine)
    engine.dispose()  # before pg_url drops the database


@pytest.fixture
def store(_sessions) -> JobStore:
    with _sessions.begin() as session:  # each test starts from an empty table
        session.execute(delete(Job))
    return JobStore(_sessions)


def _utc(value: datetime | None) -> datetime | None:
    # SQLite has no timestamp type: SQLAlchemy stores UTC wall time and reads it back naive.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def _add(store: JobStore, status: JobStatus = JobStatus.QUEUED, **values) -> uuid.UUID:
    job = Job(model="m", prompt="hi", params={}, status=status, **values)
    with store.sessions.begin() as session:
        session.add(job)
    return job.id


def _set(store: JobStore, job_id: uuid.UUID, **values) -> None:
    with store.sessions.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def _expire(store: JobStore, job_id: uuid.UUID) -> None:
    _set(store, job_id, lease_expires_at=utcnow() - timedelta(seconds=1))


def _snapshot(store: JobStore, job_id: uuid.UUID) -> dict:
    job = store.get(job_id)
    return {c.key: getattr(job, c.key) for c in Job.__mapper__.column_attrs}


def _result(text: str = "out", status: JobStatus = JobStatus.SUCCEEDED) -> JobResult:
    return JobResult(
        status=status,
        output_text=text,
        output_token_ids=[1, 2],
        prompt_tokens=3,
        completion_tokens=2,
        finish_reason="stop",
        ttft_s=0.1,
        tpot_s=0.01,
        queue_s=0.5,
    )


def test_claim_a_queued_job(store):
    job_id = _add(store)
    before = utcnow()
    assert store.claim(job_id, "w1", LEASE_S, max_attempts=3) == ClaimOutcome.CLAIMED
    job = store.get(job_id)
    assert job.status is JobStatus.RUNNING and job.attempts == 1 and job.worker_id == "w1"
    assert before + timedelta(seconds=LEASE_S - 5) < _utc(job.lease_expires_at) <= utcnow() + timedelta(seconds=LEASE_S)
    assert before - timedelta(seconds=1) <= _utc(job.admitted_at) <= utcnow()


def test_second_claim_while_the_lease_is_valid_is_owned_elsewhere(store):
    job_id = _add(store)
    assert store.claim(job_id, "w1", LEASE_S, 3) == ClaimOutcome.CLAIMED
    before = _snapshot(store, job_id)
    assert store.claim(job_id, "w2", LEASE_S, 3) == ClaimOutcome.OWNED_ELSEWHERE
    assert _snapshot(store, job_id) == before


def test_a_retried_claim_whose_first_reply_was_lost_is_still_the_owners(store):
    """The first claim committed, the connection dropped before its reply: the retry finds the row
    already owned by the same worker and takes it, without counting a second attempt (the job
    runner's active set keeps a process from claiming a job it is running)."""
    job_id = _add(store)
    assert store.claim(job_id, "w1", LEASE_S, 3) == ClaimOutcome.CLAIMED
    first_lease = _utc(store.get(job_id).lease_expires_at)
    assert store.claim(job_id, "w1", LEASE_S, 3) == ClaimOutcome.CLAIMED
    job = store.get(job_id)
    assert job.status is JobStatus.RUNNING and job.worker_id == "w1" and job.attempts == 1
    assert _utc(job.lease_expires_at) >= first_lease


def test_claim_while_cancelling_is_owned_elsewhere(store):
    job_id = _add(
        store, JobStatus.CANCELLING, worker_id="w1", attempts=1, lease_expires_at=utcnow() + timedelta(seconds=LEASE_S)
    )
    before = _snapshot(store, job_id)
    assert store.claim(job_id, "w2", LEASE_S, 3) == ClaimOutcome.OWNED_ELSEWHERE
    assert _snapshot(store, job_id) == before


@pytest.mark.parametrize("status", sorted(TERMINAL_JOB_STATUSES, key=lambda s: s.value))
def test_claim_of_a_terminal_job_is_already_done_and_changes_nothing(store, status):
    job_id = _add(
        store,
        status,
        worker_id="w1",
        attempts=1,
        output_text="kept",
        lease_expires_at=utcnow() - timedelta(seconds=5),
        finished_at=utcnow(),
    )
    before = _snapshot(store, job_id)
    assert store.claim(job_id, "w2", LEASE_S, 3) == ClaimOutcome.ALREADY_DONE
    assert _snapshot(store, job_id) == before


def test_claim_of_a_missing_job_is_already_done(store):
    assert store.claim(uuid.uuid4(), "w1", LEASE_S, 3) == ClaimOutcome.ALREADY_DONE


def test_claim_after_the_lease_expired_takes_the_job_over(store):
    job_id = _add(store)
    assert store.claim(job_id, "w1", LEASE_S, 3) == ClaimOutcome.CLAIMED
    _expire(store, job_id)
    assert store.claim(job_id, "w2", LEASE_S, 3) == ClaimOutcome.CLAIMED
    job = store.get(job_id)
    assert job.status is JobStatus.RUNNING and job.attempts == 2 and job.worker_id == "w2"
    assert _utc(job.lease_expires_at) > utcnow() + timedelta(seconds=LEASE_S - 5)


def test_exceeding_max_attempts_fails_the_job(store):
    job_id = _add(store)
    assert store.claim(job_id, "w1", LEASE_S, max_attempts=2) == ClaimOutcome.CLAIMED
    _expire(store, job_id)
    assert store.claim(job_id, "w2", LEASE_S, max_attempts=2) == ClaimOutcome.CLAIMED
    _expire(store, job_id)
    assert store.claim(job_id, "w3", LEASE_S, max_attempts=2) == ClaimOutcome.TOO_MANY_ATTEMPTS
    job = store.get(job_id)
    assert job.status is JobStatus.FAILED
    assert job.error and "2 attempts" in job.error
    assert job.finished_at is not None
    # terminal from now on: no further claim or finish touches it
    before = _snapshot(store, job_id)
    assert store.claim(job_id, "w4", LEASE_S, max_attempts=2) == ClaimOutcome.ALREADY_DONE
    assert store.finish(job_id, "w3", _result()) is False
    assert _snapshot(store, job_id) == before


def test_finish_by_the_owner(store):
    job_id = _add(store)
    store.claim(job_id, "w1", LEASE_S, 3)
    assert store.finish(job_id, "w1", _result("hello")) is True
    job = store.get(job_id)
    assert job.status is JobStatus.SUCCEEDED
    assert (job.output_text, job.output_token_ids, job.finish_reason) == ("hello", [1, 2], "stop")
    assert (job.prompt_tokens, job.completion_tokens, job.ttft_s) == (3, 2, 0.1)
    assert job.lease_expires_at is None and job.finished_at is not None


def test_finish_by_a_stale_worker_or_after_the_end_does_not_overwrite(store):
    job_id = _add(store)
    store.claim(job_id, "w1", LEASE_S, 3)
    _expire(store, job_id)
    store.claim(job_id, "w2", LEASE_S, 3)  # w1 lost its lease to w2
    before = _snapshot(store, job_id)
    assert store.finish(job_id, "w1", _result("stale")) is False
    assert _snapshot(store, job_id) == before

    assert store.finish(job_id, "w2", _result("fresh")) is True
    done = _snapshot(store, job_id)
    assert done["output_text"] == "fresh"
    assert store.finish(job_id, "w2", _result("again", JobStatus.FAILED)) is False  # redelivered finish
    assert store.finish(job_id, "w1", _result("stale")) is False
    assert _snapshot(store, job_id) == done


def test_finish_a_cancelling_job(store):
    job_id = _add(store)
    store.claim(job_id, "w1", LEASE_S, 3)
    _set(store, job_id, status=JobStatus.CANCELLING)
    assert store.finish(job_id, "w1", _result("partial", JobStatus.CANCELLED)) is True
    assert store.get(job_id).status is JobStatus.CANCELLED


def test_renew_leases_extends_only_the_owners_running_jobs(store):
    old = utcnow() + timedelta(seconds=5)
    mine = [_add(store, JobStatus.RUNNING, worker_id="w1", lease_expires_at=old) for _ in range(2)]
    expired_mine = _add(store, JobStatus.RUNNING, worker_id="w1", lease_expires_at=utcnow() - timedelta(seconds=1))
    theirs = _add(store, JobStatus.RUNNING, worker_id="w2", lease_expires_at=old)
    cancelling_mine = _add(store, JobStatus.CANCELLING, worker_id="w1", lease_expires_at=old)
    done_mine = _add(store, JobStatus.SUCCEEDED, worker_id="w1", lease_expires_at=old)
    not_listed = _add(store, JobStatus.RUNNING, worker_id="w1", lease_expires_at=old)

    store.renew_leases([*mine, expired_mine, theirs, cancelling_mine, done_mine], "w1", 600)

    threshold = utcnow() + timedelta(seconds=590)
    for job_id in [*mine, expired_mine]:
        assert _utc(store.get(job_id).lease_expires_at) > threshold
    for job_id in [theirs, cancelling_mine, done_mine, not_listed]:
        assert _utc(store.get(job_id).lease_expires_at) == old

    store.renew_leases([], "w1", 600)  # no jobs: no query, no error


def test_expired_running_jobs_lists_only_running_rows_past_their_lease(store):
    past, future = utcnow() - timedelta(seconds=5), utcnow() + timedelta(seconds=LEASE_S)
    expired = {_add(store, JobStatus.RUNNING, worker_id="w1", lease_expires_at=past) for _ in range(3)}
    _add(store, JobStatus.RUNNING, worker_id="w1", lease_expires_at=future)
    _add(store, JobStatus.QUEUED, lease_expires_at=past)
    _add(store, JobStatus.CANCELLING, worker_id="w1", lease_expires_at=past)
    for status in TERMINAL_JOB_STATUSES:
        _add(store, status, worker_id="w1", lease_expires_at=past)

    assert {ref.id for ref in store.expired_running_jobs()} == expired
    assert {ref.model for ref in store.expired_running_jobs()} == {"m"}
    assert len(store.expired_running_jobs(limit=2)) == 2


def test_cancel_requested_among_finds_only_cancelling_jobs(store):
    by_status = {status: _add(store, status) for status in JobStatus}
    missing = uuid.uuid4()
    assert store.cancel_requested_among([*by_status.values(), missing]) == {by_status[JobStatus.CANCELLING]}
    assert store.cancel_requested_among([]) == set()


def test_release_hands_a_running_job_back_without_counting_the_attempt(store):
    job_id = _add(store)
    assert store.claim(job_id, "w1", LEASE_S, 3) is ClaimOutcome.CLAIMED
    assert not store.release(job_id, "w2")  # only the owner may hand it back
    assert store.release(job_id, "w1")
    job = store.get(job_id)
    assert (job.status, job.attempts, job.worker_id, job.lease_expires_at) == (JobStatus.QUEUED, 0, None, None)
    assert store.claim(job_id, "w2", LEASE_S, 3) is ClaimOutcome.CLAIMED
    assert store.get(job_id).attempts == 1


def test_release_leaves_a_cancelling_job_to_its_owner(store):
    job_id = _add(store)
    store.claim(job_id, "w1", LEASE_S, 3)
    store.request_cancel([job_id])
    assert not store.release(job_id, "w1")
    assert store.get(job_id).status is JobStatus.CANCELLING


def test_mark_orphaned_makes_a_job_visible_to_the_orphan_sweep(store):
    job_id = _add(store)
    assert job_id not in {ref.id for ref in store.expired_running_jobs()}
    store.mark_orphaned(job_id, "w1")
    assert job_id in {ref.id for ref in store.expired_running_jobs()}
    done = _add(store, JobStatus.SUCCEEDED)
    store.mark_orphaned(done, "w1")  # a finished job is never revived
    assert store.get(done).status is JobStatus.SUCCEEDED


def test_queued_jobs_pages_through_every_queued_row_once(store):
    queued = {_add(store) for _ in range(7)}
    _add(store, JobStatus.RUNNING, worker_id="w1")
    _add(store, JobStatus.SUCCEEDED)
    seen, after = [], None
    while page := store.queued_jobs(after=after, limit=3):
        seen.extend(ref.id for ref in page)
        after = page[-1][0]
    assert sorted(seen) == sorted(queued) and len(seen) == len(queued)


def test_finish_stores_text_with_nul_characters(store):
    # Models emit NUL; Postgres text cannot hold it. The exact text survives in `choices`.
    job_id = _add(store)
    store.claim(job_id, "w1", LEASE_S, 3)
    text = "a\x00b"
    assert store.finish(
        job_id, "w1", JobResult(JobStatus.SUCCEEDED, output_text=text, choices=[{"index": 0, "text": text}])
    )
    job = store.get(job_id)
    assert job.choices[0]["text"] == text
    assert job.output_text == "a\ufffdb"
