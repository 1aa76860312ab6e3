"""Group transitions of JobStore (claim_many, finish_many, release_many) on Postgres and SQLite:
one statement for many rows, with each row's condition kept (a group may be partly claimed,
partly written), exactly as the single-row transitions behave row by row."""

from __future__ import annotations

from datetime import timedelta

from tests.store.test_job_store import LEASE_S, _add, _expire, _result, _sessions, _sqlite_module_url, store  # noqa: F401
from tokenloom.store.jobs.job_store import ClaimOutcome, JobResult
from tokenloom.store.models import JobStatus, utcnow


def test_a_group_is_claimed_row_by_row_in_one_call(store):
    queued = [_add(store) for _ in range(3)]
    done = _add(store, JobStatus.SUCCEEDED)
    live_elsewhere = _add(store, JobStatus.RUNNING, worker_id="w2", lease_expires_at=utcnow() + timedelta(seconds=60))
    orphan = _add(
        store, JobStatus.RUNNING, worker_id="dead", attempts=1, lease_expires_at=utcnow() - timedelta(seconds=1)
    )
    exhausted = _add(
        store, JobStatus.RUNNING, worker_id="dead", attempts=3, lease_expires_at=utcnow() - timedelta(seconds=1)
    )
    missing = _add(store)
    store.claim(missing, "w3", LEASE_S, 3)  # taken by another live worker meanwhile

    claims = store.claim_many([*queued, done, live_elsewhere, orphan, exhausted, missing], "w1", LEASE_S, 3)

    outcomes = {job_id: claim.outcome for job_id, claim in claims.items()}
    assert [outcomes[j] for j in queued] == [ClaimOutcome.CLAIMED] * 3
    assert outcomes[done] is ClaimOutcome.ALREADY_DONE
    assert outcomes[live_elsewhere] is ClaimOutcome.OWNED_ELSEWHERE
    assert outcomes[orphan] is ClaimOutcome.CLAIMED and claims[orphan].job.attempts == 2
    assert outcomes[exhausted] is ClaimOutcome.TOO_MANY_ATTEMPTS
    assert store.get(exhausted).status is JobStatus.FAILED and "gave up after 3 attempts" in store.get(exhausted).error
    assert outcomes[missing] is ClaimOutcome.OWNED_ELSEWHERE
    for job_id in [*queued, orphan]:
        row = store.get(job_id)
        assert (row.status, row.worker_id) == (JobStatus.RUNNING, "w1")
        assert claims[job_id].job.prompt == "hi"  # the claimed row comes back whole: no second read


def test_a_group_reclaimed_by_its_owner_is_not_a_second_attempt(store):
    # The claim committed but its reply was lost: the retry finds the rows already ours.
    jobs = [_add(store) for _ in range(2)]
    store.claim_many(jobs, "w1", LEASE_S, 3)
    again = store.claim_many(jobs, "w1", LEASE_S, 3)
    assert all(claim.outcome is ClaimOutcome.CLAIMED for claim in again.values())
    assert [store.get(j).attempts for j in jobs] == [1, 1]


def test_finish_many_writes_only_rows_the_worker_still_owns(store):
    ours = [_add(store) for _ in range(3)]
    stolen = _add(store)
    store.claim_many([*ours, stolen], "w1", LEASE_S, 3)
    _expire(store, stolen)
    store.claim(stolen, "w2", LEASE_S, 3)  # w1 lost this one's lease to w2
    cancelled_meanwhile = ours[2]
    store.request_cancel([cancelled_meanwhile])  # cancelling rows are still the owner's to record

    results = [(job_id, _result(f"text {i}")) for i, job_id in enumerate(ours)]
    results.append((stolen, _result("stale")))
    results[2] = (cancelled_meanwhile, _result("partial", JobStatus.CANCELLED))
    written = store.finish_many("w1", results)

    assert written == set(ours)
    assert [store.get(j).output_text for j in ours] == ["text 0", "text 1", "partial"]
    assert store.get(cancelled_meanwhile).status is JobStatus.CANCELLED
    assert store.get(stolen).status is JobStatus.RUNNING and store.get(stolen).worker_id == "w2"
    assert all(store.get(j).lease_expires_at is None and store.get(j).finished_at is not None for j in ours)
    assert store.finish_many("w1", results) == set()  # a redelivered write changes nothing


def test_finish_many_types_columns_that_are_null_in_every_row(store):
    jobs = [_add(store) for _ in range(2)]
    store.claim_many(jobs, "w1", LEASE_S, 3)
    failed = JobResult(JobStatus.FAILED, error="bad \x00 input")  # no timings, no tokens, no choices
    assert store.finish_many("w1", [(j, failed) for j in jobs]) == set(jobs)
    assert store.get(jobs[0]).error == "bad \ufffd input" and store.get(jobs[0]).first_token_at is None


def test_release_many_hands_back_only_running_rows_of_the_owner(store):
    running = [_add(store) for _ in range(2)]
    cancelling = _add(store)
    store.claim_many([*running, cancelling], "w1", LEASE_S, 3)
    store.request_cancel([cancelling])
    assert store.release_many([*running, cancelling], "w1") == set(running)
    assert all(store.get(j).status is JobStatus.QUEUED and store.get(j).attempts == 0 for j in running)
    assert store.get(cancelling).status is JobStatus.CANCELLING
    assert store.release_many(running, "w1") == set()
