"""Tests for priority preemption in engine/core/scheduler.py (engine/core/priority_preemption.py).

A pending sequence of strictly better (lower) priority than the worst running one is admitted at
the next step even when `max_num_seqs` or the KV pool is full; running sequences of strictly worse
priority make way, worst first, and finish later with the tokens they would have had anyway.
"""

import random

import pytest

from tests.engine.core.test_scheduler import (
    Workload,
    expected_tokens,
    fake_token,
    make_scheduler,
    make_workload,
    pool_size,
    run_workload,
    step,
)
from tests.engine.sequences import make_seq
from tokenloom.engine.core.priority_preemption import Room, Victim, lower_priority_tail, num_victims_needed
from tokenloom.engine.core.sequence import SequenceStatus


def start(sched, *seqs):
    for seq in seqs:
        sched.add(seq)
    step(sched)


def run_to_end(sched, max_steps=1_000):
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return
        step(sched)
    raise AssertionError("the scheduler made no progress")


def test_important_arrival_is_admitted_next_step_when_max_num_seqs_is_full():
    sched = make_scheduler(max_num_seqs=2, budget=32)
    a, b = make_seq(0, 3, max_tokens=20, priority=1), make_seq(1, 3, max_tokens=20, priority=1)
    start(sched, a, b)
    urgent = make_seq(2, 5, max_tokens=4, priority=0)
    sched.add(urgent)
    plan = step(sched)
    assert urgent in [c.seq for c in plan.chunks]
    assert plan.preempted == [b]  # the newest of the worst priority, and only one
    assert sched.running == [urgent, a] and sched.waiting == [b]
    assert sched.num_priority_preemptions == 1


def test_important_arrival_is_admitted_next_step_when_the_pool_is_full():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=8, budget=32)
    a, b = make_seq(0, 6, max_tokens=20, priority=1), make_seq(1, 6, max_tokens=20, priority=1)
    start(sched, a, b)  # 2 blocks each: the pool is full
    urgent = make_seq(2, 3, max_tokens=4, priority=0)
    sched.add(urgent)
    plan = step(sched)
    assert sorted(c.seq.seq_id for c in plan.chunks) == [0, 2]  # a still decodes; b's chunk was dropped
    assert plan.preempted == [b] and b.block_table == [] and b.status is SequenceStatus.WAITING


def test_victim_is_swapped_out_when_the_swap_space_has_room():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=8, budget=32, swap_blocks=8)
    a, b = (
        make_seq(0, 6, max_tokens=10, priority=1),
        make_seq(1, 6, max_tokens=10, priority=1),
    )  # 4 blocks each at the end
    start(sched, a, b)
    urgent = make_seq(2, 3, max_tokens=4, priority=0)
    sched.add(urgent)
    plan = step(sched)
    assert urgent in [c.seq for c in plan.chunks]
    assert plan.preempted == [b] and sched.swapped == [b] and b.num_computed_tokens == 6
    assert plan.swap_out and not plan.swap_in
    run_to_end(sched)
    for seq in (a, b, urgent):
        assert seq.token_ids == expected_tokens(
            seq.seq_id, seq.token_ids[: seq.num_prompt_tokens], seq.params.max_tokens
        )


def test_waiting_important_sequence_goes_before_swapped_less_important_one():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32, max_num_seqs=8, swap_blocks=8)
    a = make_seq(0, 3, max_tokens=10, priority=0, arrival=0)
    b = make_seq(1, 3, max_tokens=10, priority=1, arrival=1)
    start(sched, a, b)
    while not sched.swapped:  # a and b grow until the pool is short and b (less important) is swapped out
        step(sched)
    assert sched.swapped == [b]
    urgent = make_seq(2, 12, max_tokens=2, priority=0, arrival=2)  # three blocks: b cannot come back beside it
    sched.add(urgent)
    while a in sched.running:
        step(sched)
    plan = step(sched)
    assert [c.seq for c in plan.chunks] == [urgent] and sched.swapped == [b]


def test_equal_priority_never_preempts():
    sched = make_scheduler(max_num_seqs=2, budget=32)
    a, b = make_seq(0, 3, max_tokens=20, priority=1), make_seq(1, 3, max_tokens=20, priority=1)
    start(sched, a, b)
    earlier = make_seq(2, 3, max_tokens=4, priority=1, arrival=-1)  # earlier arrival does not count
    sched.add(earlier)
    plan = step(sched)
    assert plan.preempted == [] and sched.waiting == [earlier] and sched.num_priority_preemptions == 0


def test_victims_are_always_less_important_than_the_admitted_sequence():
    sched = make_scheduler(max_num_seqs=4, budget=64)
    running = [make_seq(i, 3, max_tokens=30, priority=p) for i, p in enumerate([0, 2, 1, 2])]
    start(sched, *running)
    for seq_id in (10, 11, 12):
        sched.add(make_seq(seq_id, 3, max_tokens=30, priority=1))
        plan = step(sched)
        assert all(victim.priority > 1 for victim in plan.preempted)
    assert [s.priority for s in sched.running] == [0, 1, 1, 1]
    assert [s.seq_id for s in sched.waiting] == [12, 1, 3]  # 12 found no worse sequence left to replace


def test_repeated_important_arrivals_do_not_starve_the_others_once_they_stop():
    sched = make_scheduler(max_num_seqs=2, budget=32)
    batch = [make_seq(i, 5, max_tokens=12, priority=1) for i in range(3)]
    for seq in batch:
        sched.add(seq)
    interactive = []
    for n in range(20):
        interactive.append(make_seq(100 + n, 4, max_tokens=3, priority=0))
        sched.add(interactive[-1])
        step(sched)
    run_to_end(sched)
    assert sum(s.num_preemptions for s in batch) > 0
    for seq in batch + interactive:
        assert seq.is_finished
        assert seq.token_ids == expected_tokens(
            seq.seq_id, seq.token_ids[: seq.num_prompt_tokens], seq.params.max_tokens
        )


def test_worse_chunk_is_deferred_when_the_budget_is_spent():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, budget=8)
    batch = make_seq(0, 40, max_tokens=4, priority=1)
    start(sched, batch)  # a long prefill that takes the whole budget each step
    urgent = make_seq(1, 3, max_tokens=4, priority=0)
    sched.add(urgent)
    plan = step(sched)
    # batch's chunk gives way, not its blocks, and takes what the budget has left
    assert [(c.seq, c.start, c.num_tokens) for c in plan.chunks] == [(urgent, 0, 3), (batch, 8, 5)]
    assert plan.preempted == [] and sched.running == [urgent, batch]


def run_plan(sched, plan):
    """The rest of `step()` for a plan made by hand: advance, then sample for the chunks that do."""
    sched.advance(plan)
    for chunk in plan.chunks:
        if chunk.samples:
            chunk.seq.token_ids.append(fake_token(chunk.seq.seq_id, chunk.seq.num_tokens))


def swapped_by_hand(sched, seq, num_computed):
    """Put `seq` in the swapped list as if its first `num_computed` tokens had been swapped out."""
    seq.num_computed_tokens = num_computed
    seq.host_block_table = sched.swap.allocate(-(-num_computed // sched.kv_manager.block_size))
    seq.status = SequenceStatus.SWAPPED
    sched.swapped.append(seq)


def test_swapped_important_sequence_waits_a_step_after_swap_outs():
    sched = make_scheduler(max_num_seqs=2, budget=32, swap_blocks=16)
    a, b = make_seq(0, 3, max_tokens=20, priority=1), make_seq(1, 3, max_tokens=20, priority=1)
    start(sched, a, b)
    urgent = make_seq(2, 6, max_tokens=4, priority=0)
    swapped_by_hand(sched, urgent, 5)
    plan = sched.schedule()
    assert plan.preempted == [b] and plan.swap_out and not plan.swap_in  # b swapped out: no swap-in now
    assert urgent not in [c.seq for c in plan.chunks]
    run_plan(sched, plan)
    plan = sched.schedule()
    assert plan.swap_in and [c.seq for c in plan.chunks if c.seq is urgent] == [urgent]


def test_swapped_important_sequence_comes_back_at_once_when_its_victim_is_recomputed():
    sched = make_scheduler(max_num_seqs=2, budget=32, swap_blocks=2)
    a, b = make_seq(0, 3, max_tokens=20, priority=1), make_seq(1, 3, max_tokens=20, priority=1)
    start(sched, a, b)
    urgent = make_seq(2, 6, max_tokens=4, priority=0)
    swapped_by_hand(sched, urgent, 5)  # takes the whole swap space: b can only be recomputed
    plan = sched.schedule()
    assert plan.preempted == [b] and b.status is SequenceStatus.WAITING
    assert plan.swap_in and not plan.swap_out and urgent in [c.seq for c in plan.chunks]


def test_lower_priority_tail_stops_at_an_equal_priority():
    running = [make_seq(i, 3, priority=p) for i, p in enumerate([0, 1, 1, 2, 3])]
    assert [s.seq_id for s in lower_priority_tail(running, make_seq(9, 3, priority=1))] == [4, 3]


def test_num_victims_needed_counts_seats_blocks_and_given_back_budget():
    victims = [Victim(make_seq(i, 3), num_released_blocks=2, num_planned_tokens=1) for i in range(3)]

    def blocks_to_admit(budget):  # a chunk of up to 10 tokens, 4 tokens per block
        return -(-min(budget, 10) // 4)

    assert num_victims_needed(Room(num_free_seats=1, num_free_blocks=5, budget=8), victims, blocks_to_admit) == 0
    assert num_victims_needed(Room(num_free_seats=0, num_free_blocks=5, budget=8), victims, blocks_to_admit) == 1
    assert num_victims_needed(Room(num_free_seats=1, num_free_blocks=1, budget=8), victims, blocks_to_admit) == 1
    assert num_victims_needed(Room(num_free_seats=1, num_free_blocks=0, budget=0), victims, blocks_to_admit) == 1
    assert num_victims_needed(Room(num_free_seats=0, num_free_blocks=0, budget=8), victims[:1], blocks_to_admit) is None


def test_step_may_only_swap_out_when_every_running_sequence_makes_way():
    # The engine must still copy such a plan's swap-outs although it has nothing to compute.
    sched = make_scheduler(max_num_seqs=1, budget=32, swap_blocks=16)
    batch = make_seq(0, 3, max_tokens=20, priority=1)
    start(sched, batch)
    urgent = make_seq(1, 6, max_tokens=4, priority=0)
    swapped_by_hand(sched, urgent, 5)
    plan = sched.schedule()
    assert plan.is_empty and plan.preempted == [batch] and plan.swap_out and not plan.swap_in
    run_plan(sched, plan)
    assert [c.seq for c in sched.schedule().chunks] == [urgent]


# (seed, block_size, pool size, budget, max_num_seqs, swap blocks as a multiple of the pool)
MIXED_PRIORITY_CONFIGS = [
    (33, 4, "tight", 16, 4, 0.0),
    (34, 4, "medium", 32, 4, 1.0),
    (34, 16, "roomy", 24, 3, 0.0),
    (34, 4, "tight", 64, 8, 0.3),
    (35, 4, "medium", 64, 4, 0.5),
    (34, 4, "medium", 8, 2, 1.0),
]


@pytest.mark.parametrize(
    "config", MIXED_PRIORITY_CONFIGS, ids=[f"seed{c[0]}-{c[2]}-swap{c[5]}" for c in MIXED_PRIORITY_CONFIGS]
)
def test_randomized_mixed_priorities_keep_invariants_and_end_with_expected_tokens(config):
    """The randomized harness of test_scheduler.py (its invariants checked after every step), with
    every sequence's priority drawn from 0..3, so more important arrivals keep preempting."""
    seed, block_size, size, budget, max_num_seqs, swap_share = config
    rng = random.Random(seed)
    base = make_workload(rng)
    workload = Workload(
        [(i, prompt, max_tokens, rng.randrange(4), arrival) for i, prompt, max_tokens, _, arrival in base.seqs]
    )
    num_blocks = pool_size(workload, block_size, size)
    stats = run_workload(
        workload, block_size, num_blocks, budget, max_num_seqs, swap_blocks=int(swap_share * num_blocks)
    )
    assert stats.priority_preemptions > 0
    for seq_id, prompt, max_tokens, _, _ in workload.seqs:
        assert stats.final_tokens[seq_id] == expected_tokens(seq_id, prompt, max_tokens)


def test_share_rank_orders_equal_priorities_before_arrival_and_never_preempts():
    """A tenant's later batch line (rank 0) goes ahead of an earlier tenant's deeper lines, but only
    into a free slot: ranks decide admission order, never who is preempted."""
    sched = make_scheduler(max_num_seqs=2, budget=64)
    a0, a1 = make_seq(0, 3, max_tokens=3, priority=5), make_seq(1, 3, max_tokens=3, priority=5)
    a0.share_rank, a1.share_rank = 0, 1
    start(sched, a0, a1)
    a2, b0 = make_seq(2, 3, max_tokens=3, priority=5), make_seq(3, 3, max_tokens=3, priority=5)
    a2.share_rank, b0.share_rank = 2, 0
    sched.add(a2)
    sched.add(b0)
    plan = step(sched)
    assert not plan.preempted and {c.seq.seq_id for c in plan.chunks} == {0, 1}  # the batch is full: both wait
    assert sched.waiting == [b0, a2]  # b0 arrived later but ranks first among equal priorities
    run_to_end(sched)
    assert sched.num_preemptions == 0
