"""Fair claims of batch lines across projects (store/jobs/fair_claim.py), against real Postgres."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import timedelta

import pytest
from sqlalchemy import delete, insert

from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.fair_claim import pick_fair
from tokenloom.store.jobs.job_store import ClaimOutcome, JobStore
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus, utcnow

LEASE_S = 30.0
MODEL = "fair-model"


@pytest.fixture
def store(pg_url):
    engine = make_sql_engine(pg_url)
    store = JobStore(make_session_factory(engine))
    with store.sessions.begin() as session:
        session.execute(delete(Job))
    yield store
    engine.dispose()


def _lines(
    store: JobStore,
    project: str,
    n: int,
    *,
    work_class=WorkClass.BATCH,
    status=JobStatus.QUEUED,
    model: str = MODEL,
    start=None,
) -> list[uuid.UUID]:
    """`n` rows of one project, in submission order (created_at one millisecond apart)."""
    start = start or utcnow()
    rows = [
        dict(
            id=uuid.uuid4(),
            model=model,
            project=project,
            prompt="p",
            params={},
            status=status,
            work_class=work_class,
            line_number=i,
            created_at=start + timedelta(milliseconds=i),
        )
        for i in range(n)
    ]
    with store.sessions.begin() as session:
        session.execute(insert(Job), rows)
    return [row["id"] for row in rows]


def _projects(store: JobStore, ids) -> Counter:
    with store.sessions() as session:
        return Counter(session.get(Job, job_id).project for job_id in ids)


def test_a_later_project_is_served_alongside_an_earlier_one(store):
    first = _lines(store, "a", 40)
    _lines(store, "b", 40, start=utcnow() + timedelta(seconds=5))
    claimed: list[uuid.UUID] = []
    for _ in range(4):  # four messages of project a's, 8 lines each
        claims = store.claim_fair(first[:8], "w1", LEASE_S, 3)
        assert all(c.outcome is ClaimOutcome.CLAIMED for c in claims.values())
        claimed += list(claims)
    assert _projects(store, claimed) == {"a": 16, "b": 16}


def test_each_project_runs_in_submission_order(store):
    a = _lines(store, "a", 6)
    b = _lines(store, "b", 6)
    claimed = list(store.claim_fair(a[:6], "w1", LEASE_S, 3))
    assert [i for i in claimed if i in a] == a[:3] and [i for i in claimed if i in b] == b[:3]


def test_the_project_holding_fewer_running_lines_is_owed_the_next_ones(store):
    _lines(store, "a", 10, status=JobStatus.RUNNING)
    _lines(store, "a", 10)
    _lines(store, "b", 20)
    with store.sessions() as session:
        queued_a = [j.id for j in session.query(Job).filter_by(project="a", status=JobStatus.QUEUED)]
    # b catches up with a's 10 running lines first, then they alternate.
    assert _projects(store, store.claim_fair(queued_a[:10], "w1", LEASE_S, 3)) == {"b": 10}
    assert _projects(store, store.claim_fair(queued_a[:4], "w1", LEASE_S, 3)) == {"a": 2, "b": 2}
    assert store.claim_fair([uuid.uuid4()], "w1", LEASE_S, 3) == {}  # a message whose rows are gone takes nothing


def test_only_queued_batch_lines_of_the_model_are_taken(store):
    _lines(store, "a", 5, work_class=WorkClass.JOBS)
    _lines(store, "a", 5, work_class=WorkClass.INTERACTIVE)
    _lines(store, "a", 5, model="another-model")
    _lines(store, "a", 5, status=JobStatus.SUCCEEDED)
    batch = _lines(store, "a", 3)
    claims = store.claim_fair(batch, "w1", LEASE_S, 3)
    assert set(claims) == set(batch)
    assert store.claim_fair(batch, "w1", LEASE_S, 3) == {}  # none left: the hint's rows are running here


def test_a_hinted_line_whose_worker_died_is_claimed_itself(store):
    [orphan] = _lines(store, "a", 1, status=JobStatus.RUNNING)
    with store.sessions.begin() as session:
        session.get(Job, orphan).lease_expires_at = utcnow() - timedelta(seconds=1)
    queued = _lines(store, "b", 3)
    claims = store.claim_fair([orphan, queued[0]], "w2", LEASE_S, 3)
    assert set(claims) == {orphan, queued[0]}
    assert claims[orphan].job.attempts == 1 and claims[orphan].job.worker_id == "w2"


def test_a_hinted_line_running_here_is_not_claimed_again(store):
    [mine] = _lines(store, "a", 1, status=JobStatus.RUNNING)
    with store.sessions.begin() as session:  # its lease lapsed: this worker's renewal was late
        session.get(Job, mine).lease_expires_at = utcnow() - timedelta(seconds=1)
    assert store.claim_fair([mine], "w1", LEASE_S, 3, skip={mine}) == {}


def test_workers_claiming_at_once_take_different_lines(store):
    ids = _lines(store, "a", 30) + _lines(store, "b", 30)
    results: list[dict] = []
    barrier = threading.Barrier(3)

    def claim(worker: str) -> None:
        barrier.wait()
        for _ in range(5):
            results.append(store.claim_fair(ids[:4], worker, LEASE_S, 3))

    threads = [threading.Thread(target=claim, args=(f"w{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = [job_id for claims in results for job_id in claims]
    assert len(claimed) == len(set(claimed)) == 60  # SKIP LOCKED: no line twice, every message its count


def test_pick_fair_takes_nothing_for_a_zero_count(store):
    _lines(store, "a", 3)
    with store.sessions.begin() as session:
        assert pick_fair(session, MODEL, 0) == []
