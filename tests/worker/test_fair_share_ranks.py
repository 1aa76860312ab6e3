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
