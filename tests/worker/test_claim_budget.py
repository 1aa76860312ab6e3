"""worker/claim_budget.py: how many jobs of each work class a worker may still claim (pure logic)."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.worker.claim_budget import ClaimBudget

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it

MAX = 4


def _ids(n: int) -> list[uuid.UUID]:
    return [uuid.uuid4() for _ in range(n)]


def _claim(budget: ClaimBudget, work_class: WorkClass, n: int) -> list[uuid.UUID]:
    """Reserve room for n jobs and hold n new ones in its place, as a claim that took them all does."""
    assert budget.reserve(work_class, n) == n
    job_ids = _ids(n)
    budget.hold(work_class, n, job_ids)
    return job_ids


def test_an_empty_budget_has_the_limit_for_every_class():
    budget = ClaimBudget(MAX)
    assert {c: budget.room(c) for c in WorkClass} == {c: MAX for c in WorkClass}
    assert budget.held_count == 0 and budget.held_ids() == []


def test_a_reservation_takes_what_is_wanted_up_to_the_room_left():
    budget = ClaimBudget(MAX)
    assert budget.reserve(WorkClass.JOBS, 3) == 3
    assert budget.room(WorkClass.JOBS) == 1
    assert budget.reserve(WorkClass.JOBS, 10) == 1  # a part of what is wanted, not nothing
    assert budget.reserve(WorkClass.JOBS, 1) == 0  # no room: nothing reserved
    assert budget.room(WorkClass.JOBS) == 0


def test_jobs_and_batch_lines_share_one_budget():
    budget = ClaimBudget(MAX)
    _claim(budget, WorkClass.JOBS, 1)
    assert budget.reserve(WorkClass.BATCH, 2) == 2
    assert budget.room(WorkClass.JOBS) == budget.room(WorkClass.BATCH) == 1


def test_interactive_work_has_a_budget_of_its_own():
    budget = ClaimBudget(MAX)
    _claim(budget, WorkClass.JOBS, 2)
    _claim(budget, WorkClass.BATCH, 2)
    assert budget.room(WorkClass.JOBS) == 0
    assert budget.room(WorkClass.INTERACTIVE) == MAX  # a full worker still takes a chat request

    _claim(budget, WorkClass.INTERACTIVE, MAX)
    assert budget.room(WorkClass.INTERACTIVE) == 0
    assert budget.held_count == 2 * MAX  # both budgets full: twice the limit held in all


def test_interactive_work_leaves_the_other_budget_alone():
    budget = ClaimBudget(MAX)
    _claim(budget, WorkClass.INTERACTIVE, 3)
    assert budget.reserve(WorkClass.INTERACTIVE, 1) == 1
    assert budget.room(WorkClass.JOBS) == budget.room(WorkClass.BATCH) == MAX


def test_a_batch_line_gets_no_room_while_a_job_waits_for_some():
    budget = ClaimBudget(MAX)
    _claim(budget, WorkClass.BATCH, 1)
    budget.wait_begins(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == 0
    assert budget.reserve(WorkClass.BATCH, 1) == 0
    assert budget.room(WorkClass.JOBS) == MAX - 1  # the waiting job itself is not held back
    assert budget.room(WorkClass.INTERACTIVE) == MAX

    budget.wait_ends(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == MAX - 1


def test_the_batch_line_waits_for_every_waiting_job():
    budget = ClaimBudget(MAX)
    budget.wait_begins(WorkClass.JOBS)
    budget.wait_begins(WorkClass.JOBS)
    budget.wait_ends(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == 0  # one job still waits
    budget.wait_ends(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == MAX


@pytest.mark.parametrize("waiting", [WorkClass.BATCH, WorkClass.INTERACTIVE])
def test_other_waiting_classes_hold_nothing_back(waiting):
    budget = ClaimBudget(MAX)
    budget.wait_begins(waiting)
    assert {c: budget.room(c) for c in WorkClass} == {c: MAX for c in WorkClass}


def test_holding_the_claimed_jobs_uses_the_reservation_and_no_more_room():
    budget = ClaimBudget(MAX)
    assert budget.reserve(WorkClass.JOBS, 3) == 3
    job_ids = _ids(3)
    budget.hold(WorkClass.JOBS, 3, job_ids)
    assert budget.room(WorkClass.JOBS) == 1  # the same room as while reserved: never counted twice
    assert sorted(budget.held_ids()) == sorted(job_ids)
    assert all(budget.holds(job_id) for job_id in job_ids)


def test_room_a_claim_did_not_use_comes_back():
    budget = ClaimBudget(MAX)
    assert budget.reserve(WorkClass.BATCH, 3) == 3
    budget.hold(WorkClass.BATCH, 3, _ids(1))  # the claim found one line to take
    assert budget.room(WorkClass.BATCH) == MAX - 1

    assert budget.reserve(WorkClass.JOBS, 2) == 2
    budget.hold(WorkClass.JOBS, 2, [])  # the claim failed: its whole reservation comes back
    assert budget.room(WorkClass.JOBS) == MAX - 1


def test_a_released_job_gives_its_room_back_to_its_own_budget():
    budget = ClaimBudget(MAX)
    interactive = _claim(budget, WorkClass.INTERACTIVE, 2)
    jobs = _claim(budget, WorkClass.JOBS, 2)

    budget.release(interactive[0])
    assert budget.room(WorkClass.INTERACTIVE) == MAX - 1
    assert budget.room(WorkClass.JOBS) == MAX - 2
    assert not budget.holds(interactive[0])

    budget.release(jobs[0])
    assert budget.room(WorkClass.JOBS) == MAX - 1
    assert budget.room(WorkClass.INTERACTIVE) == MAX - 1


def test_releasing_an_unknown_or_released_job_changes_nothing():
    budget = ClaimBudget(MAX)
    (job_id,) = _claim(budget, WorkClass.INTERACTIVE, 1)
    budget.release(uuid.uuid4())
    budget.release(job_id)
    budget.release(job_id)
    assert budget.room(WorkClass.INTERACTIVE) == MAX  # not MAX + 1
    assert budget.held_count == 0


def test_a_job_held_twice_is_counted_once_under_its_first_class():
    budget = ClaimBudget(MAX)
    (job_id,) = _claim(budget, WorkClass.INTERACTIVE, 1)
    assert budget.reserve(WorkClass.BATCH, 1) == 1
    budget.hold(WorkClass.BATCH, 1, [job_id])
    assert budget.held_count == 1
    assert budget.room(WorkClass.BATCH) == MAX  # still counted as interactive
    budget.release(job_id)
    assert budget.room(WorkClass.INTERACTIVE) == MAX


def test_first_unheld_skips_held_jobs_and_says_how_far_it_looked():
    budget = ClaimBudget(MAX)
    held = _claim(budget, WorkClass.JOBS, 2)
    a, b, c = _ids(3)
    assert budget.first_unheld([held[0], a, held[1], b, c], 2) == ([a, b], 4)  # c was not looked at
    assert budget.first_unheld([a, held[0]], 5) == ([a], 2)  # fewer than the limit: all looked at
    assert budget.first_unheld([held[0], held[1]], 2) == ([], 2)
    assert budget.first_unheld([a], 0) == ([], 0)


def test_contract_violations_are_refused():
    with pytest.raises(ValueError):
        ClaimBudget(0)
    budget = ClaimBudget(MAX)
    with pytest.raises(ValueError):
        budget.reserve(WorkClass.JOBS, 0)
    assert budget.reserve(WorkClass.JOBS, 1) == 1
    with pytest.raises(ValueError):
        budget.hold(WorkClass.JOBS, 2, [])  # more than was reserved
    with pytest.raises(ValueError):
        budget.hold(WorkClass.BATCH, 1, [])  # reserved for another class
    assert budget.room(WorkClass.JOBS) == MAX - 1  # a refused call changes nothing


def test_the_budget_imports_no_database_queue_or_engine_library():
    probe = (
        "import sys, tokenloom.worker.claim_budget; "
        "print(sorted(m for m in ('sqlalchemy', 'redis', 'celery', 'kombu', 'psycopg', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_under_steady_job_load_batch_lines_still_get_their_guaranteed_share():
    """Issue 43: with a job always waiting, batch lines got no claim room at all. With a minimum share they
    get room up to their guarantee, and the waiting jobs cannot take that room from them."""
    budget = ClaimBudget(10, min_share=0.2)
    assert budget.guaranteed == 2
    budget.wait_begins(WorkClass.JOBS)  # steady /v1/jobs load: a job always waits
    budget.wait_begins(WorkClass.BATCH)
    assert budget.room(WorkClass.JOBS) == 8  # two of the ten are kept for the waiting batch lines
    _claim(budget, WorkClass.JOBS, 8)
    assert budget.room(WorkClass.JOBS) == 0
    assert budget.room(WorkClass.BATCH) == 2
    lines = _claim(budget, WorkClass.BATCH, 2)
    assert budget.room(WorkClass.BATCH) == 0  # at its guarantee: a waiting job goes first again
    budget.release(lines[0])
    assert budget.room(WorkClass.JOBS) == 0  # the line's room goes back to batch, still below its guarantee
    assert budget.room(WorkClass.BATCH) == 1


def test_above_its_guarantee_a_batch_line_still_waits_for_jobs():
    budget = ClaimBudget(10, min_share=0.2)
    _claim(budget, WorkClass.BATCH, 3)
    budget.wait_begins(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == 0
    assert budget.room(WorkClass.JOBS) == 7
    budget.wait_ends(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == 7  # no job waits: the whole window, as before


def test_jobs_are_guaranteed_their_share_against_a_waiting_batch_too():
    budget = ClaimBudget(10, min_share=0.1)
    budget.wait_begins(WorkClass.JOBS)
    budget.wait_begins(WorkClass.BATCH)
    assert budget.room(WorkClass.BATCH) == 1  # a job waits: batch gets only its guarantee
    budget.wait_ends(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == 10
    _claim(budget, WorkClass.BATCH, 9)
    budget.wait_begins(WorkClass.JOBS)
    assert budget.room(WorkClass.BATCH) == 0 and budget.room(WorkClass.JOBS) == 1  # the last seat is the job's


def test_a_small_window_guarantees_at_least_one_and_no_share_keeps_the_strict_order():
    assert ClaimBudget(4, min_share=0.05).guaranteed == 1
    assert ClaimBudget(4).guaranteed == 0
    with pytest.raises(ValueError):
        ClaimBudget(4, min_share=0.6)


def test_a_one_seat_window_guarantees_nothing_so_two_waiting_classes_cannot_deadlock():
    budget = ClaimBudget(1, min_share=0.5)
    assert budget.guaranteed == 0
    budget.wait_begins(WorkClass.JOBS)
    budget.wait_begins(WorkClass.BATCH)
    assert budget.room(WorkClass.JOBS) == 1  # the strict order: the job takes the one seat


def test_owed_and_waiting_say_what_a_claim_without_a_message_may_take():
    # worker/owed_batch_claims.py reads these: batch lines owed while job messages hold theirs back.
    budget = ClaimBudget(10, min_share=0.2)
    assert budget.owed(WorkClass.BATCH) == 2 and not budget.is_waiting(WorkClass.BATCH)
    _claim(budget, WorkClass.BATCH, 1)
    assert budget.owed(WorkClass.BATCH) == 1
    budget.wait_begins(WorkClass.BATCH)
    assert budget.is_waiting(WorkClass.BATCH)
    budget.wait_ends(WorkClass.BATCH)
    assert budget.owed(WorkClass.JOBS) == 2
    assert ClaimBudget(10).owed(WorkClass.BATCH) == 0  # no share: nothing is owed
