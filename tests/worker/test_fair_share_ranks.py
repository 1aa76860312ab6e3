"""worker/fair_share.py: the engine order of the batch lines a worker holds (pure logic)."""

from __future__ import annotations

import uuid

from tokenloom.worker.fair_share import FairShareRanks

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it


def _lines(ranks: FairShareRanks, project: str, n: int) -> list[tuple[uuid.UUID, int]]:
    return [(job_id, ranks.rank(job_id, project)) for job_id in (uuid.uuid4() for _ in range(n))]


def test_a_later_tenant_joins_at_the_virtual_time_and_then_they_alternate():
    ranks = FairShareRanks()
    a = _lines(ranks, "a", 8)
    for job_id, _ in a[:4]:  # a's first four ended; a still holds ranks 4..7
        ranks.release(job_id)
    b = _lines(ranks, "b", 4)
    assert [r for _, r in b] == [4, 5, 6, 7]  # level with a's waiting lines, not behind them
    assert [r for _, r in _lines(ranks, "a", 2)] == [8, 9]
    assert [r for _, r in _lines(ranks, "b", 2)] == [8, 9]


def test_a_tenant_with_a_large_batch_yesterday_has_no_debt_today():
    ranks = FairShareRanks()
    for job_id, _ in _lines(ranks, "a", 1000):
        ranks.release(job_id)
    b = _lines(ranks, "b", 1)[0][1]
    a = _lines(ranks, "a", 1)[0][1]
    assert abs(a - b) <= 1


def test_dropping_to_no_held_line_for_a_moment_gains_nothing():
    ranks = FairShareRanks()
    a = _lines(ranks, "a", 10)
    _lines(ranks, "b", 2)  # b holds ranks 0 and 1, so the virtual time stays at 0
    for job_id, _ in a:
        ranks.release(job_id)
    assert _lines(ranks, "a", 1)[0][1] == 10  # not 0: a already had its ten


def test_releasing_an_unknown_line_is_ignored():
    FairShareRanks().release(uuid.uuid4())


def test_one_long_admitted_line_does_not_freeze_the_clock():
    """Issue 43: the virtual time came from every held line, running ones included, so a line the engine ran
    for minutes kept it at its rank while its project's later lines were ranked thousands ahead, and a tenant
    arriving then jumped all of them (it got rank 0). Only lines not yet admitted set the clock now."""
    ranks = FairShareRanks()
    long_line = _lines(ranks, "a", 1)[0][0]
    ranks.admitted(long_line)  # rank 0: running in the engine for the whole test, never released
    short = _lines(ranks, "a", 5000)  # ranks 1..5000
    for job_id, _ in short[:-10]:  # 1..4990 ran and ended behind it; 4991..5000 still wait
        ranks.admitted(job_id)
        ranks.release(job_id)
    assert [r for _, r in _lines(ranks, "b", 3)] == [4991, 4992, 4993]  # level with a's first waiting line
    assert [r for _, r in _lines(ranks, "a", 1)] == [5001]


def test_the_clock_without_admissions_is_the_smallest_held_rank():
    """Before the fix a held long line set the clock: the same lines, none admitted, show the old behaviour
    is kept for lines that really wait (a newcomer is level with the first of them)."""
    ranks = FairShareRanks()
    _lines(ranks, "a", 1)  # rank 0, still waiting in the engine
    for job_id, _ in _lines(ranks, "a", 99):
        ranks.release(job_id)
    assert _lines(ranks, "b", 1)[0][1] == 0


def test_admitting_an_unknown_or_ended_line_is_ignored():
    ranks = FairShareRanks()
    job_id, _ = _lines(ranks, "a", 1)[0]
    ranks.release(job_id)
    ranks.admitted(job_id)
    ranks.admitted(uuid.uuid4())
    assert _lines(ranks, "b", 1)[0][1] == 0
