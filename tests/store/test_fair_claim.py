"""Fair claims of batch lines across projects (store/jobs/fair_claim.py), against real Postgres."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections import Counter
from datetime import timedelta

import pytest
from sqlalchemy import delete, insert
from sqlalchemy.exc import OperationalError

from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.db_retry import with_db_retry
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


def _claim_at_once(store: JobStore, hint: list[uuid.UUID], threads: int, workers: int, messages: int) -> list[dict]:
    """`threads` claim threads over `workers` workers start together, each claiming `messages`
    messages of `hint` (a batch message's count); every claim's result, in no particular order."""
    results: list[dict] = []
    barrier = threading.Barrier(threads)

    def claim(worker: str) -> None:
        barrier.wait()
        for _ in range(messages):
            results.append(store.claim_fair(hint, worker, LEASE_S, 3))

    running = [threading.Thread(target=claim, args=(f"w{i % workers}",)) for i in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return results


def test_workers_claiming_at_once_take_different_lines(store):
    ids = _lines(store, "a", 30) + _lines(store, "b", 30)
    results = _claim_at_once(store, ids[:4], threads=3, workers=3, messages=5)
    claimed = [job_id for claims in results for job_id in claims]
    assert len(claimed) == len(set(claimed)) == 60  # SKIP LOCKED: no line twice, every message its count


def test_many_claimers_at_once_each_get_their_whole_count(store):
    # Two workers of eight claim threads, all at once, each claiming message after message of 32
    # lines: every claim gets its 32 while lines remain (a claim that came back short would strand
    # lines until the stranded-message sweep).
    _lines(store, "a", 1300)
    hint = _lines(store, "b", 1300)
    results = _claim_at_once(store, hint[:32], threads=16, workers=2, messages=5)
    assert sorted(len(claims) for claims in results) == [32] * 80
    claimed = [job_id for claims in results for job_id in claims]
    assert len(set(claimed)) == 2560


def test_pick_fair_takes_nothing_for_a_zero_count(store):
    _lines(store, "a", 3)
    with store.sessions.begin() as session:
        assert pick_fair(session, MODEL, 0) == []


class _LostReplySessions:
    """The store's sessionmaker, whose first transaction commits in Postgres and then raises as if the
    connection dropped before the commit's reply came back (what the worker sees in that case)."""

    def __init__(self, sessions) -> None:
        self._sessions = sessions
        self.lost = 0

    def __call__(self, *args, **kwargs):
        return self._sessions(*args, **kwargs)

    @contextlib.contextmanager
    def begin(self):
        with self._sessions.begin() as session:
            yield session
        if not self.lost:  # committed: now lose the reply
            self.lost += 1
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))


def _claim_retrying(store: JobStore, hint: list[uuid.UUID], worker: str, *, adopt: bool) -> dict:
    """Claim as the JobRunner does: one stamp for the claim, retried through the outage, a retry adopting."""
    stamp = utcnow()
    tries = 0

    def claim_once():
        nonlocal tries
        tries += 1
        return store.claim_fair(hint, worker, LEASE_S, 3, claimed_at=stamp, adopt=adopt and tries > 1)

    return with_db_retry(claim_once, "claiming batch lines", 30.0)


def _running_under(store: JobStore, worker: str) -> dict[uuid.UUID, int]:
    with store.sessions() as session:
        return {
            job.id: job.attempts
            for job in session.query(Job).filter_by(worker_id=worker, status=JobStatus.RUNNING).all()
        }


def test_a_claim_whose_commit_reply_is_lost_adopts_the_lines_it_took(store):
    """Issue 43: the first try committed 4 lines, its reply was lost; the retry picked 4 other lines and the
    first ones ran under the worker untracked until their leases expired, charged an attempt."""
    hint = _lines(store, "a", 6)[:4]
    _lines(store, "b", 6)
    flaky = JobStore(_LostReplySessions(store.sessions))
    claims = _claim_retrying(flaky, hint, "w1", adopt=True)
    assert flaky.sessions.lost == 1  # the reply of the first, committed, try was lost
    assert len(claims) == 4 and all(c.outcome is ClaimOutcome.CLAIMED for c in claims.values())
    running = _running_under(store, "w1")
    assert set(running) == set(claims)  # every line running here is tracked: none left to time out
    assert set(running.values()) == {1}  # the retry charged no second attempt
    assert all(c.job.lease_expires_at > utcnow() + timedelta(seconds=LEASE_S / 2) for c in claims.values())


def test_without_adoption_a_lost_reply_leaves_lines_running_untracked(store):
    """The failure the adoption fixes, reproduced: the same lost reply, retried without adopting."""
    hint = _lines(store, "a", 6)[:4]
    _lines(store, "b", 6)
    claims = _claim_retrying(JobStore(_LostReplySessions(store.sessions)), hint, "w1", adopt=False)
    untracked = set(_running_under(store, "w1")) - set(claims)
    assert len(claims) == 4 and len(untracked) == 4


def test_adoption_takes_only_this_claims_lines(store):
    """Another claim of the same worker (another stamp) and another worker's lines are never adopted."""
    hint = _lines(store, "a", 10)[:2]
    earlier = store.claim_fair(hint, "w1", LEASE_S, 3, claimed_at=utcnow())
    elsewhere = store.claim_fair(hint, "w2", LEASE_S, 3, claimed_at=utcnow())
    claims = store.claim_fair(hint, "w1", LEASE_S, 3, claimed_at=utcnow(), adopt=True)
    assert len(claims) == 2 and not set(claims) & (set(earlier) | set(elsewhere))


def test_a_claim_by_count_takes_the_models_queued_lines_fairly_without_a_message(store):
    # worker/owed_batch_claims.py: a worker's owed batch lines, claimed while their messages wait at Redis.
    _lines(store, "a", 6, work_class=WorkClass.JOBS)
    _lines(store, "a", 6, model="another-model")
    a = _lines(store, "a", 6)
    b = _lines(store, "b", 6, start=utcnow() + timedelta(seconds=5))
    claims = store.claim_fair_count(MODEL, 4, "w1", LEASE_S, 3, claimed_at=utcnow())
    assert all(c.outcome is ClaimOutcome.CLAIMED for c in claims.values())
    assert set(claims) == {*a[:2], *b[:2]}
    assert len(store.claim_fair_count(MODEL, 100, "w1", LEASE_S, 3)) == 8  # what is left, no more
    assert store.claim_fair_count(MODEL, 3, "w1", LEASE_S, 3) == {}


def test_a_claim_by_count_whose_reply_is_lost_adopts_its_lines(store):
    _lines(store, "a", 6)
    stamp = utcnow()
    first = store.claim_fair_count(MODEL, 3, "w1", LEASE_S, 3, claimed_at=stamp)
    retry = store.claim_fair_count(MODEL, 3, "w1", LEASE_S, 3, claimed_at=stamp, adopt=True)
    assert set(retry) == set(first)  # the retry takes back its own lines, not three more
    assert _running_under(store, "w1") == dict.fromkeys(first, 1)
