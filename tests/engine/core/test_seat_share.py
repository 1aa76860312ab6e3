"""Guaranteed seats per class (engine/core/seat_share.py) in the scheduler.

A steady stream of better-priority requests that alone fills `max_num_seqs` still leaves each
other class with work its guaranteed seats: a batch finishes under a chat stream that never stops,
and priority preemption never takes a class below its guarantee. With one class, or a share of 0,
the scheduler plans exactly as strict priority does.
"""

import itertools
import random

import pytest

from tests.engine.core.test_scheduler import (
    SWAP_CONFIGS,
    expected_tokens,
    make_scheduler,
    make_workload,
    pool_size,
    run_workload,
    step,
)
from tests.engine.sequences import make_seq
from tokenloom.engine.core.seat_share import SeatShare, guaranteed_seats

CHAT, BATCH = 0, 2  # seat classes: the worker passes the class of work's rank
BATCH_PRIORITY = 20_000  # any priority worse than the chat stream's


@pytest.mark.parametrize(
    ("max_num_seqs", "share", "seats"),
    [(64, 0.1, 6), (256, 0.1, 25), (4, 0.1, 1), (4, 0.25, 1), (8, 0.5, 4), (1, 0.5, 1), (64, 0.0, 0), (3, 0.5, 1)],
)
def test_guaranteed_seats_are_the_share_at_least_one_at_most_half(max_num_seqs, share, seats):
    assert guaranteed_seats(max_num_seqs, share) == seats


def _stream_until_batch_ends(guaranteed: int, max_steps: int = 400) -> tuple[int | None, int]:
    """Chat requests (10 tokens each) keep 2 x max_num_seqs pending all along; two batch lines (20
    tokens each) wait from the start. Returns the step the batch ended at (None: never) and the
    most chat sequences running at once."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=4, budget=64, guaranteed=guaranteed)
    ids = itertools.count()
    batch = [
        make_seq(next(ids), 4, max_tokens=20, priority=BATCH_PRIORITY, seat_class=BATCH, arrival=0) for _ in range(2)
    ]
    for seq in batch:
        sched.add(seq)
    most_chat = 0
    for step_no in range(1, max_steps + 1):
        while sum(s.seat_class == CHAT for s in sched.waiting) < 8:
            seq_id = next(ids)
            sched.add(make_seq(seq_id, 4, max_tokens=10, seat_class=CHAT, arrival=seq_id))
        step(sched)
        most_chat = max(most_chat, sum(s.seat_class == CHAT for s in sched.running))
        if all(seq.is_finished for seq in batch):
            return step_no, most_chat
    return None, most_chat


def test_a_batch_finishes_under_a_chat_stream_that_alone_fills_the_engine():
    ended_at, most_chat = _stream_until_batch_ends(guaranteed=1)
    assert ended_at is not None
    # One seat for the batch: its two 20-token lines one after the other, about 40 steps.
    assert ended_at <= 2 * 20 + 10, ended_at
    assert most_chat == 3  # chat keeps every other seat


def test_without_a_guarantee_the_same_stream_starves_the_batch():
    # The control: what the guarantee is for (strict priority never seats the batch).
    ended_at, most_chat = _stream_until_batch_ends(guaranteed=0)
    assert ended_at is None and most_chat == 4


def test_priority_preemption_leaves_another_class_its_guaranteed_seats():
    sched = make_scheduler(max_num_seqs=4, budget=64, guaranteed=1)
    batch = [make_seq(i, 3, max_tokens=30, priority=BATCH_PRIORITY, seat_class=BATCH) for i in range(4)]
    for seq in batch:
        sched.add(seq)
    step(sched)
    assert len(sched.running) == 4
    chats = [make_seq(10 + i, 3, max_tokens=5, seat_class=CHAT, arrival=10 + i) for i in range(4)]
    for seq in chats:
        sched.add(seq)
    plan = step(sched)
    assert plan.preempted == batch[:0:-1]  # the three newest lines, worst first; the oldest keeps its seat
    assert sorted(s.seq_id for s in sched.running) == [0, 10, 11, 12]
    assert sched.waiting[0] is chats[3]  # the fourth chat waits: no seat left that it may take


def test_a_class_below_its_guarantee_takes_the_next_free_seat_without_preempting():
    sched = make_scheduler(max_num_seqs=2, budget=64, guaranteed=1)
    chats = [make_seq(i, 3, max_tokens=3 + i, seat_class=CHAT) for i in range(2)]
    for seq in chats:
        sched.add(seq)
    step(sched)
    line = make_seq(5, 3, max_tokens=5, priority=BATCH_PRIORITY, seat_class=BATCH, arrival=5)
    later_chat = make_seq(6, 3, max_tokens=5, seat_class=CHAT, arrival=6)
    sched.add(line)
    sched.add(later_chat)
    plan = step(sched)
    assert not plan.preempted  # the guarantee waits for a seat to free, it never evicts
    while not chats[0].is_finished:
        step(sched)
    step(sched)  # the first step after a seat freed
    assert line in sched.running
    assert later_chat in sched.waiting  # the freed seat went to the class below its guarantee


def test_within_a_class_priority_orders_as_before():
    shares = SeatShare(guaranteed=2)
    a, b = make_seq(0, 3, seat_class=CHAT), make_seq(1, 3, seat_class=BATCH)
    for seq in (a, b):
        shares.pending_added(seq)
    assert shares.starved_classes() == {CHAT, BATCH}
    for seq in (a, b):
        shares.pending_removed(seq)
        shares.running_added(seq)
    assert shares.starved_classes() == set()  # nothing pending: nobody is owed a seat
    victims = [make_seq(2 + i, 3, seat_class=BATCH) for i in range(3)]
    for seq in victims:
        shares.running_added(seq)
    # BATCH runs 4 of which 2 are owed: a chat may take 2, a batch line any of its own class.
    assert shares.preemptible(victims, for_class=CHAT) == victims[:2]
    assert shares.preemptible(victims, for_class=BATCH) == victims


@pytest.mark.parametrize("seed", [30, 31, 32])
def test_randomized_mixed_classes_keep_invariants_and_end_with_expected_tokens(seed):
    # Seat class = priority (three classes): run_workload checks every plan and the seat counts.
    workload = make_workload(random.Random(seed))
    num_blocks = pool_size(workload, 4, "tight")
    stats = run_workload(workload, 4, num_blocks, 32, 6, swap_blocks=num_blocks // 2, guaranteed=1, seat_classes=True)
    for seq_id, prompt, max_tokens, _, _ in workload.seqs:
        assert stats.final_tokens[seq_id] == expected_tokens(seq_id, prompt, max_tokens)


@pytest.mark.parametrize("config", SWAP_CONFIGS, ids=[f"seed{c[0]}" for c in SWAP_CONFIGS])
def test_one_class_with_a_guarantee_plans_exactly_as_strict_priority(config):
    seed, block_size, budget, max_num_seqs, swap_share = config
    workload = make_workload(random.Random(seed))
    num_blocks = pool_size(workload, block_size, "tight")
    sizes = (block_size, num_blocks, budget, max_num_seqs)
    swap_blocks = max(1, int(swap_share * num_blocks))
    strict = run_workload(workload, *sizes, swap_blocks=swap_blocks)
    owed = run_workload(workload, *sizes, swap_blocks=swap_blocks, guaranteed=max_num_seqs // 2)
    assert (owed.steps, owed.preemptions, owed.final_tokens) == (strict.steps, strict.preemptions, strict.final_tokens)
