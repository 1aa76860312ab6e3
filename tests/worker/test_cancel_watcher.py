"""worker/cancel_watcher.py: one poll marks and aborts the held jobs that are cancelling (fakes, no services)."""

from __future__ import annotations

import threading
import time
import uuid

from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.worker.cancel_watcher import CancelWatcher
from tokenloom.worker.claim_budget import ClaimBudget

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it


class FakeStore:
    def __init__(self, cancelling: set[uuid.UUID] | None = None, fail: bool = False):
        self.cancelling = cancelling or set()
        self.fail = fail
        self.asked: list[list[uuid.UUID]] = []
        self.on_ask = lambda: None

    def cancel_requested_among(self, job_ids: list[uuid.UUID]) -> set[uuid.UUID]:
        self.asked.append(list(job_ids))
        self.on_ask()
        if self.fail:
            raise ConnectionError("database down")
        return self.cancelling & set(job_ids)


def _held(budget: ClaimBudget, n: int) -> list[uuid.UUID]:
    job_ids = [uuid.uuid4() for _ in range(n)]
    budget.reserve(WorkClass.JOBS, n)
    budget.hold(WorkClass.JOBS, n, job_ids)
    return job_ids


def _watcher(store: FakeStore, budget: ClaimBudget, aborted: list[str], lock: threading.Lock | None = None):
    return CancelWatcher(store, budget, lock or threading.Lock(), aborted.append, poll_s=0.01)


def test_a_poll_marks_and_aborts_the_cancelling_held_jobs_only():
    budget = ClaimBudget(8)
    a, b, c = _held(budget, 3)
    elsewhere = uuid.uuid4()
    store = FakeStore({b, elsewhere})
    aborted: list[str] = []
    watcher = _watcher(store, budget, aborted)

    assert watcher.poll() == {b}
    assert sorted(store.asked[0]) == sorted([a, b, c])  # one query for every held job
    assert aborted == [str(b)]
    assert watcher.is_cancelled(b) and not watcher.is_cancelled(a) and not watcher.is_cancelled(elsewhere)


def test_nothing_is_asked_while_no_job_is_held():
    store = FakeStore()
    watcher = _watcher(store, ClaimBudget(8), [])
    assert watcher.poll() == set()
    assert store.asked == []


def test_a_job_that_ended_during_the_query_is_not_marked():
    budget = ClaimBudget(8)
    lock = threading.Lock()
    (job_id,) = _held(budget, 1)
    store = FakeStore({job_id})
    store.on_ask = lambda: budget.release(job_id)  # ends while the query runs (outside the lock)
    aborted: list[str] = []
    watcher = _watcher(store, budget, aborted, lock)
    assert watcher.poll() == set()
    assert aborted == [] and not watcher.is_cancelled(job_id)


def test_a_failed_query_is_let_go_and_asked_again_next_poll():
    budget = ClaimBudget(8)
    (job_id,) = _held(budget, 1)
    store = FakeStore({job_id}, fail=True)
    aborted: list[str] = []
    watcher = _watcher(store, budget, aborted)
    assert watcher.poll() == set()
    store.fail = False
    assert watcher.poll() == {job_id}
    assert aborted == [str(job_id)]


def test_forget_drops_the_mark_of_an_ended_job():
    budget = ClaimBudget(8)
    (job_id,) = _held(budget, 1)
    watcher = _watcher(FakeStore({job_id}), budget, [])
    watcher.poll()
    watcher.forget(job_id)
    assert not watcher.is_cancelled(job_id)


def test_the_thread_polls_until_stopped():
    budget = ClaimBudget(8)
    (job_id,) = _held(budget, 1)
    store = FakeStore({job_id})
    aborted: list[str] = []
    watcher = _watcher(store, budget, aborted).start()
    deadline = time.monotonic() + 10
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop()
    assert aborted and aborted[0] == str(job_id)
    polls = len(store.asked)
    time.sleep(0.05)
    assert len(store.asked) == polls  # stopped: no more queries
