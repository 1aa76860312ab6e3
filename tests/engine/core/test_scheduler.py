"""Tests for engine/core/scheduler.py: continuous batching, chunked prefill, preemption, prefix reuse.

A fake model runner drives the scheduler: each sampled token depends only on (seq_id, length),
so a sequence that was preempted and recomputed must end with exactly the tokens it would have
had without preemption.
"""

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from tests.engine.sequences import make_seq
from tokenloom.engine.core.block_pool import BlockPool
from tokenloom.engine.core.kv_cache_manager import KVCacheManager
from tokenloom.engine.core.scheduler import Scheduler
from tokenloom.engine.core.sequence import FinishReason, SequenceStatus
from tokenloom.engine.core.swap_space import SwapSpace


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, budget=32, prefix_caching=True, swap_blocks=0, guaranteed=0
):
    kv = KVCacheManager(BlockPool(num_blocks, prefix_caching), block_size)
    swap = SwapSpace(swap_blocks) if swap_blocks else None
    return Scheduler(
        kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, swap=swap, guaranteed_seats_per_class=guaranteed
    )


def fake_token(seq_id, length):
    return hash((seq_id, length)) % 100


def expected_tokens(seq_id, prompt, max_tokens):
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_tokens:
        tokens.append(fake_token(seq_id, len(tokens)))
    return tokens


def step(sched):
    """One engine step with the fake runner; returns the plan."""
    plan = sched.schedule()
    sched.advance(plan)
    for chunk in plan.chunks:
        if chunk.samples:
            seq = chunk.seq
            seq.token_ids.append(fake_token(seq.seq_id, seq.num_tokens))
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
    return plan


def chunk_summary(plan):
    return [(c.seq.seq_id, c.start, c.num_tokens, c.samples) for c in plan.chunks]


# --- randomized workloads -----------------------------------------------------------------


@dataclass
class Workload:
    seqs: list  # (seq_id, prompt, max_tokens, priority, arrival_step)


@dataclass
class RunStats:
    steps: int = 0
    preemptions: int = 0
    priority_preemptions: int = 0  # of which made way for a more important pending sequence
    chunked_prefills: int = 0  # chunks with 1 < num_tokens < remaining tokens
    prefix_hit_tokens: int = 0
    max_running: int = 0
    swapped_blocks: int = 0
    final_tokens: dict = field(default_factory=dict)


def make_workload(rng, num_seqs=None):
    num_seqs = num_seqs or rng.randint(30, 60)
    shared_prefixes = [[rng.randrange(100, 200) for _ in range(rng.randint(8, 48))] for _ in range(3)]
    seqs = []
    arrival_step = 0
    for seq_id in range(num_seqs):
        length = rng.randint(1, 80)
        r = rng.random()
        if r < 0.35:  # shares a prefix with others
            prefix = rng.choice(shared_prefixes)
            k = min(length, len(prefix))
            prompt = prefix[:k] + [rng.randrange(100, 200) for _ in range(length - k)]
        elif r < 0.45 and seqs:  # an exact repeat of an earlier prompt
            prompt = list(rng.choice(seqs)[1])
        else:
            prompt = [rng.randrange(100, 200) for _ in range(length)]
        max_tokens = rng.randint(1, 30)
        priority = rng.choice([0, 0, 0, 1, 2]) if rng.random() < 0.3 else 0
        arrival_step += rng.choice([0, 0, 0, 1, 2])
        seqs.append((seq_id, prompt, max_tokens, priority, arrival_step))
    return Workload(seqs)


def blocks_for(n, block_size):
    return -(-n // block_size)


def check_plan(sched, plan, all_seqs, budget, max_num_seqs, kv_content, prefix_hashes):
    kv = sched.kv_manager
    pool = kv.pool
    bs = kv.block_size

    assert plan.num_batched_tokens <= budget
    assert len(plan.chunks) <= max_num_seqs
    assert len(sched.running) <= max_num_seqs
    assert len({id(c.seq) for c in plan.chunks}) == len(plan.chunks), "a sequence scheduled twice"

    # decodes (single-token chunks) first
    kinds = [c.num_tokens == 1 for c in plan.chunks]
    assert kinds == sorted(kinds, reverse=True)

    running_ids = {id(s) for s in sched.running}
    waiting_ids = {id(s) for s in sched.waiting}
    swapped_ids = {id(s) for s in sched.swapped}
    assert not running_ids & waiting_ids and not swapped_ids & (running_ids | waiting_ids)
    assert sched.running == sorted(sched.running, key=lambda s: s.sort_key)
    assert sched.waiting == sorted(sched.waiting, key=lambda s: s.sort_key)
    assert sched.swapped == sorted(sched.swapped, key=lambda s: s.sort_key)
    for seq in plan.preempted:
        assert seq.block_table == []
        if id(seq) in swapped_ids:  # KV kept in host blocks, nothing to recompute
            assert seq.status is SequenceStatus.SWAPPED and seq.num_computed_tokens > 0
            assert len(seq.host_block_table) == blocks_for(seq.num_computed_tokens, bs)
        else:
            assert id(seq) in waiting_ids and seq.num_computed_tokens == 0
    assert not (plan.swap_out and plan.swap_in), "a step swaps one way only"
    if sched.swap is not None:  # host blocks: each held by exactly one swapped sequence
        held = [b for seq in sched.swapped for b in seq.host_block_table]
        assert len(held) == len(set(held)) == sched.swap.num_blocks - sched.swap.num_free_blocks

    for c in plan.chunks:
        seq = c.seq
        assert id(seq) in running_ids
        assert seq.status is SequenceStatus.RUNNING
        assert c.num_tokens >= 1
        assert c.start == seq.num_computed_tokens
        assert c.end <= seq.num_tokens
        assert c.samples == (c.end == seq.num_tokens)
        assert len(seq.block_table) * bs >= c.end, "chunk's blocks do not cover its tokens"
        # the blocks this chunk writes are private and not in the prefix cache
        for b in {seq.block_table[p // bs] for p in range(c.start, c.end)}:
            assert pool.ref_counts[b] == 1, "a shared block would be written"
            assert pool.block_keys[b] is None, "a cached block would be overwritten"
        # what attention reads for positions < start is this sequence's own prefix
        hashes = prefix_hashes(seq)
        for p in range(c.start):
            slot = (seq.block_table[p // bs], p % bs)
            assert kv_content.get(slot) == hashes[p], f"seq {seq.seq_id} reads stale KV at {p}"

    # waiting and finished sequences hold nothing; swapped ones hold only host blocks
    for seq in all_seqs:
        if id(seq) in swapped_ids:
            assert seq.block_table == [] and seq.host_block_table
        elif id(seq) not in running_ids:
            assert seq.block_table == [] and seq.host_block_table == []
            assert seq.num_computed_tokens == 0
        else:
            assert len(seq.block_table) <= blocks_for(seq.num_tokens, bs)
            assert len(set(seq.block_table)) == len(seq.block_table)

    # ref counts == number of tables holding each block; shared blocks are full prefix blocks
    holders = {}
    for seq in sched.running:
        for i, b in enumerate(seq.block_table):
            holders.setdefault(b, []).append((seq, i))
    for b in range(pool.num_blocks):
        n = len(holders.get(b, []))
        assert pool.ref_counts[b] == n, f"block {b}: ref count {pool.ref_counts[b]} != {n} holders"
        assert pool.is_free(b) == (n == 0)
    for b, hs in holders.items():
        if len(hs) > 1:
            (seq0, i0), *rest = hs
            assert pool.block_keys[b] is not None
            for seq, i in rest:
                assert i == i0, "shared block at different positions"
                assert seq.token_ids[: (i + 1) * bs] == seq0.token_ids[: (i + 1) * bs]
            for seq, i in hs:
                assert seq.num_computed_tokens >= (i + 1) * bs
    assert pool.num_free_blocks == pool.num_blocks - len(holders)

    # prefix-cache index is consistent
    for key, b in pool.cached_blocks.items():
        assert pool.block_keys[b] == key
    assert sum(k is not None for k in pool.block_keys) == len(pool.cached_blocks)


def check_seat_counts(sched):
    """The seat share's counts per class (engine/core/seat_share.py) match the scheduler's queues."""
    running = Counter(s.seat_class for s in sched.running)
    pending = Counter(s.seat_class for s in (*sched.waiting, *sched.swapped))
    assert +sched.seats.num_running == running and +sched.seats.num_pending == pending


def run_workload(
    workload,
    block_size,
    num_blocks,
    budget,
    max_num_seqs,
    prefix_caching=True,
    swap_blocks=0,
    guaranteed=0,
    seat_classes=False,
):
    """`guaranteed` seats per class (engine/core/seat_share.py); with `seat_classes`, each sequence's
    seat class is its priority, else all share class 0."""
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, prefix_caching, swap_blocks, guaranteed)
    pool = sched.kv_manager.pool
    pending = sorted(workload.seqs, key=lambda w: w[4])
    all_seqs = []
    kv_content = {}  # (block, slot) -> hash of the token prefix whose K/V the slot holds
    host_content = {}  # the same for swap-space blocks

    hash_cache = {}  # seq_id -> hashes of token_ids[:p + 1] for each p (tokens only grow)

    def prefix_hashes(seq):
        out = hash_cache.setdefault(seq.seq_id, [])
        for t in seq.token_ids[len(out) :]:
            out.append(hash((out[-1] if out else None, t)))
        return out

    stats = RunStats()
    step_no = 0
    while pending or sched.has_unfinished:
        while pending and pending[0][4] <= step_no:
            seq_id, prompt, max_tokens, priority, _ = pending.pop(0)
            seq = make_seq(
                seq_id, prompt, max_tokens, priority, arrival=seq_id, seat_class=priority if seat_classes else 0
            )
            all_seqs.append(seq)
            sched.add(seq)
        step_no += 1
        assert step_no < 20_000, "scheduler made no progress"

        plan = sched.schedule()
        # The runner copies swapped blocks before the forward pass: model that, so the stale-KV
        # check in check_plan proves a swapped-in sequence reads exactly what it wrote before.
        for src, dst, src_content, dst_content in (
            *((d, h, kv_content, host_content) for d, h in plan.swap_out),
            *((h, d, host_content, kv_content) for h, d in plan.swap_in),
        ):
            for slot in range(block_size):
                dst_content[(dst, slot)] = src_content.get((src, slot))
        stats.swapped_blocks += len(plan.swap_out)
        check_plan(sched, plan, all_seqs, budget, max_num_seqs, kv_content, prefix_hashes)
        check_seat_counts(sched)
        stats.max_running = max(stats.max_running, len(sched.running))
        stats.preemptions += len(plan.preempted)
        if sched.has_unfinished and not plan.preempted:
            assert plan.chunks, "idle step with work pending"
        for c in plan.chunks:
            if 1 < c.num_tokens < c.seq.num_tokens - c.start:
                stats.chunked_prefills += 1
            hashes = prefix_hashes(c.seq)
            for p in range(c.start, c.end):  # the forward pass writes these slots
                kv_content[(c.seq.block_table[p // block_size], p % block_size)] = hashes[p]

        sched.advance(plan)
        for c in plan.chunks:
            assert c.seq.num_computed_tokens == c.end
            if c.samples:
                seq = c.seq
                seq.token_ids.append(fake_token(seq.seq_id, seq.num_tokens))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, FinishReason.LENGTH)

    stats.steps = step_no
    stats.prefix_hit_tokens = sched.kv_manager.num_prefix_hits
    stats.priority_preemptions = sched.num_priority_preemptions
    assert stats.preemptions == sched.num_preemptions == sum(s.num_preemptions for s in all_seqs)
    # no leaks
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.ref_counts == [0] * pool.num_blocks
    assert not sched.waiting and not sched.running and not sched.swapped
    if sched.swap is not None:
        assert sched.swap.num_free_blocks == sched.swap.num_blocks
    for seq in all_seqs:
        assert seq.is_finished
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.block_table == []
        stats.final_tokens[seq.seq_id] = list(seq.token_ids)
    assert len(stats.final_tokens) == len(workload.seqs)
    return stats


# (seed, block_size, pool size, budget, max_num_seqs, prefix caching)
CONFIGS = [
    (0, 4, "tight", 8, 4, True),
    (1, 16, "tight", 32, 8, True),
    (2, 4, "tight", 128, 16, True),
    (3, 16, "tight", 16, 16, False),
    (4, 4, "tight", 64, 1, True),
    (5, 16, "medium", 64, 16, True),
    (6, 4, "medium", 16, 2, True),
    (7, 4, "medium", 128, 8, False),
    (8, 16, "roomy", 128, 16, True),
    (9, 4, "roomy", 8, 1, True),
    (10, 4, "tight", 24, 12, True),
    (11, 16, "tight", 48, 6, True),
]


def pool_size(workload, block_size, size):
    per_seq = [blocks_for(len(p) + m, block_size) for _, p, m, _, _ in workload.seqs]
    tight = max(per_seq)  # exactly one longest sequence fits
    return {"tight": tight, "medium": 3 * tight, "roomy": sum(per_seq) + 1}[size]


def run_config(seed, block_size, size, budget, max_num_seqs, prefix_caching):
    workload = make_workload(random.Random(seed))
    num_blocks = pool_size(workload, block_size, size)
    stats = run_workload(workload, block_size, num_blocks, budget, max_num_seqs, prefix_caching)
    huge = sum(blocks_for(len(p) + m, block_size) for _, p, m, _, _ in workload.seqs) + 1
    reference = run_workload(workload, block_size, huge, budget, max_num_seqs, prefix_caching)
    return workload, stats, reference


_results = {}


def results(config):
    if config not in _results:
        _results[config] = run_config(*config)
    return _results[config]


@pytest.mark.parametrize("config", CONFIGS, ids=[f"seed{c[0]}-bs{c[1]}-{c[2]}" for c in CONFIGS])
def test_randomized_workload_keeps_invariants_and_ends_with_expected_tokens(config):
    workload, stats, reference = results(config)
    # A roomy pool preempts only to seat a more important arrival when max_num_seqs is reached.
    assert reference.preemptions == reference.priority_preemptions
    assert stats.final_tokens == reference.final_tokens
    for seq_id, prompt, max_tokens, _, _ in workload.seqs:
        assert stats.final_tokens[seq_id] == expected_tokens(seq_id, prompt, max_tokens)


# (seed, block_size, budget, max_num_seqs, swap blocks as a multiple of the pool): 1.0 swaps every
# preempted sequence; 0.2 runs out of swap space, so swapping and recompute mix.
SWAP_CONFIGS = [(20, 4, 32, 8, 1.0), (21, 16, 64, 16, 1.0), (22, 4, 24, 12, 0.2), (23, 4, 128, 16, 0.2)]


@pytest.mark.parametrize("config", SWAP_CONFIGS, ids=[f"seed{c[0]}-bs{c[1]}-swap{c[4]}" for c in SWAP_CONFIGS])
def test_randomized_swapping_keeps_invariants_and_ends_with_expected_tokens(config):
    seed, block_size, budget, max_num_seqs, swap_share = config
    workload = make_workload(random.Random(seed))
    num_blocks = pool_size(workload, block_size, "tight")
    stats = run_workload(
        workload, block_size, num_blocks, budget, max_num_seqs, swap_blocks=max(1, int(swap_share * num_blocks))
    )
    assert stats.preemptions > 0 and stats.swapped_blocks > 0
    for seq_id, prompt, max_tokens, _, _ in workload.seqs:
        assert stats.final_tokens[seq_id] == expected_tokens(seq_id, prompt, max_tokens)


def _fill_pool_until_preemption(sched, a, b):
    """Decode a and b (one 4-token block each to start) until a step preempts; return that plan."""
    for seq in (a, b):
        sched.add(seq)
    while True:
        snapshot = {seq.seq_id: (list(seq.block_table), seq.num_computed_tokens) for seq in (a, b)}
        plan = sched.schedule()
        if plan.preempted:
            return plan, snapshot
        sched.advance(plan)
        for chunk in plan.chunks:
            chunk.seq.token_ids.append(fake_token(chunk.seq.seq_id, chunk.seq.num_tokens))


def test_preempted_sequence_is_swapped_out_and_comes_back_without_recompute():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32, max_num_seqs=8, swap_blocks=8)
    a = make_seq(0, 3, max_tokens=10, priority=0, arrival=0)
    b = make_seq(1, 3, max_tokens=10, priority=1, arrival=1)
    plan, before = _fill_pool_until_preemption(sched, a, b)  # a needs a third block: b goes
    blocks_b, computed_b = before[b.seq_id]
    assert plan.preempted == [b] and sched.swapped == [b]
    assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == computed_b == 8
    assert b.block_table == [] and plan.swap_out == list(zip(blocks_b, b.host_block_table))
    sched.advance(plan)
    a.token_ids.append(fake_token(a.seq_id, a.num_tokens))
    sched.finish(a, FinishReason.LENGTH)
    plan = sched.schedule()  # room again: b returns first and only decodes its last token
    assert [(c.seq, c.start, c.num_tokens) for c in plan.chunks] == [(b, computed_b, 1)]
    assert [host for host, _ in plan.swap_in] == [0, 1] and b.host_block_table == []
    assert sched.swap.num_free_blocks == 8


def test_aborting_a_swapped_sequence_frees_its_host_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32, max_num_seqs=8, swap_blocks=8)
    a, b = make_seq(0, 3, max_tokens=10, arrival=0), make_seq(1, 3, max_tokens=10, priority=1, arrival=1)
    _fill_pool_until_preemption(sched, a, b)
    assert b.status is SequenceStatus.SWAPPED
    sched.finish(b, FinishReason.ABORT)
    assert sched.swapped == [] and sched.swap.num_free_blocks == 8 and b.host_block_table == []


def test_randomized_tight_pools_actually_preempt():
    tight = [c for c in CONFIGS if c[2] == "tight" and c[4] > 1]
    preemptions = [results(c)[1].preemptions for c in tight]
    assert sum(preemptions) > 0
    assert sum(p > 0 for p in preemptions) >= len(tight) // 2, preemptions


def test_randomized_small_budgets_actually_chunk_prefills():
    small = [c for c in CONFIGS if c[3] <= 32]
    assert all(results(c)[1].chunked_prefills > 0 for c in small)


def test_randomized_shared_prefixes_actually_hit_the_prefix_cache():
    cached = [c for c in CONFIGS if c[5]]
    assert sum(results(c)[2].prefix_hit_tokens > 0 for c in cached) >= len(cached) // 2


def test_randomized_running_set_reaches_max_num_seqs_when_roomy():
    config = next(c for c in CONFIGS if c[2] == "roomy" and c[4] > 1)
    _, stats, _ = results(config)
    assert stats.max_running == config[4]


# --- scheduler behaviour ------------------------------------------------------------------


def test_add_puts_sequence_in_waiting_queue():
    sched = make_scheduler()
    seq = make_seq(1, 5)
    sched.add(seq)
    assert sched.waiting == [seq]
    assert seq.status is SequenceStatus.WAITING
    assert sched.has_unfinished


def test_empty_scheduler_plans_an_empty_step():
    sched = make_scheduler()
    plan = sched.schedule()
    assert plan.is_empty
    assert plan.preempted == []
    assert plan.num_batched_tokens == 0
    assert not sched.has_unfinished


def test_short_prompt_is_prefilled_in_one_chunk_that_samples():
    sched = make_scheduler(budget=32)
    seq = make_seq(1, 10)
    sched.add(seq)
    plan = sched.schedule()
    assert chunk_summary(plan) == [(1, 0, 10, True)]
    assert sched.running == [seq] and sched.waiting == []
    assert seq.status is SequenceStatus.RUNNING
    assert len(seq.block_table) == 3


def test_running_sequence_decodes_one_token_per_step():
    sched = make_scheduler(budget=32)
    seq = make_seq(1, 10, max_tokens=5)
    sched.add(seq)
    step(sched)
    for n in range(4):
        plan = step(sched)
        assert chunk_summary(plan) == [(1, 11 + n - 1, 1, True)]
    assert seq.is_finished
    assert seq.num_output_tokens == 5


def test_long_prompt_is_split_across_steps_by_the_budget():
    sched = make_scheduler(budget=16, num_blocks=64)
    seq = make_seq(1, 50)
    sched.add(seq)
    plans = [step(sched) for _ in range(4)]
    assert [chunk_summary(p) for p in plans] == [
        [(1, 0, 16, False)],
        [(1, 16, 16, False)],
        [(1, 32, 16, False)],
        [(1, 48, 2, True)],
    ]
    assert seq.num_output_tokens == 1
    assert seq.num_computed_tokens == 50


def test_several_waiting_prompts_are_packed_into_one_step():
    sched = make_scheduler(budget=32, max_num_seqs=8)
    seqs = [make_seq(i, n) for i, n in enumerate([5, 6, 4, 30])]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    # the last prompt gets the leftover budget (32 - 15 = 17) and continues next step
    assert chunk_summary(plan) == [(0, 0, 5, True), (1, 0, 6, True), (2, 0, 4, True), (3, 0, 17, False)]
    assert plan.num_batched_tokens == 32
    assert sched.waiting == []


def test_admission_stops_at_max_num_seqs():
    sched = make_scheduler(budget=128, max_num_seqs=2)
    seqs = [make_seq(i, 3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == seqs[:2]
    assert sched.waiting == seqs[2:]


def test_admission_stops_when_pool_is_short_and_keeps_order():
    sched = make_scheduler(budget=128, num_blocks=3, block_size=4)
    big, small = make_seq(0, 12), make_seq(1, 2)
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == [big]  # takes all 3 blocks
    assert sched.waiting == [small]  # no block left for it
    assert sched.kv_manager.pool.num_free_blocks == 0


def test_waiting_head_that_does_not_fit_blocks_later_sequences():
    sched = make_scheduler(budget=128, num_blocks=4, block_size=4)
    first = make_seq(0, 8, max_tokens=20)
    sched.add(first)
    step(sched)  # first: 2 blocks, 9 tokens; its decode takes a third block, leaving one free
    big, small = make_seq(1, 12), make_seq(2, 1)
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == [first]  # FCFS: small does not jump the queue
    assert sched.waiting == [big, small]


def test_decodes_come_first_in_chunks():
    sched = make_scheduler(budget=32, num_blocks=64, max_num_seqs=4)
    decoder = make_seq(1, 2, max_tokens=10, priority=1)
    sched.add(decoder)
    step(sched)  # decoder prefilled
    prefiller = make_seq(2, 50, priority=0)  # more important: sorts first in `running`
    sched.add(prefiller)
    step(sched)  # decoder decodes, prefiller admitted with 31 tokens
    assert sched.running == [prefiller, decoder]
    plan = step(sched)
    assert chunk_summary(plan) == [(1, 3, 1, True), (2, 31, 19, True)]


def test_decode_and_prefill_chunks_are_both_scheduled_in_one_step():
    sched = make_scheduler(budget=16, max_num_seqs=4)
    a = make_seq(0, 3, max_tokens=10)
    sched.add(a)
    step(sched)
    b = make_seq(1, 40)
    sched.add(b)
    plan = step(sched)
    assert chunk_summary(plan) == [(0, 3, 1, True), (1, 0, 15, False)]


def test_running_sequences_get_budget_before_waiting_ones():
    sched = make_scheduler(budget=8, max_num_seqs=4)
    a = make_seq(0, 20)
    sched.add(a)
    step(sched)
    b = make_seq(1, 4)
    sched.add(b)
    plan = sched.schedule()
    assert chunk_summary(plan) == [(0, 8, 8, False)]
    assert sched.waiting == [b]


def preemption_setup():
    """Four running sequences filling a 4-block pool, each one full block after the sample."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32, max_num_seqs=8)
    a = make_seq(0, 3, max_tokens=10, priority=0, arrival=0)
    b = make_seq(1, 3, max_tokens=10, priority=1, arrival=1)
    c = make_seq(2, 3, max_tokens=10, priority=0, arrival=2)
    d = make_seq(3, 3, max_tokens=10, priority=1, arrival=3)
    for s in (a, b, c, d):
        sched.add(s)
    plan = step(sched)
    assert len(plan.chunks) == 4 and sched.kv_manager.pool.num_free_blocks == 0
    assert sched.running == [a, c, b, d]
    return sched, a, b, c, d


def test_preemption_picks_lowest_priority_newest_sequence():
    sched, a, b, c, d = preemption_setup()
    # all four now have 4 tokens, 3 computed: each decode fits its block. Fill them up.
    plan = step(sched)
    assert plan.preempted == []
    # 5 tokens each, 4 computed: every decode needs a new block and the pool is empty
    plan = sched.schedule()
    # a needs a block: d (priority 1, newest) goes; c needs one: b (priority 1) goes, not c
    assert plan.preempted == [d, b]
    assert [ch.seq for ch in plan.chunks] == [a, c]
    assert sched.running == [a, c]
    assert sched.num_preemptions == 2


def test_preempted_sequence_returns_to_waiting_with_tokens_kept():
    sched, a, b, c, d = preemption_setup()
    step(sched)
    tokens_b, tokens_d = list(b.token_ids), list(d.token_ids)
    plan = sched.schedule()
    assert plan.preempted == [d, b]
    for seq, tokens in ((b, tokens_b), (d, tokens_d)):
        assert seq.status is SequenceStatus.WAITING
        assert seq.num_computed_tokens == 0
        assert seq.block_table == []
        assert seq.token_ids == tokens
        assert seq.num_output_tokens == 2
        assert seq.num_preemptions == 1
    assert sched.waiting == [b, d]  # by priority, then arrival


def test_no_admission_in_a_step_that_preempted():
    sched, a, b, c, d = preemption_setup()
    step(sched)
    e = make_seq(9, 1, priority=0, arrival=-1)
    sched.add(e)
    plan = sched.schedule()
    assert plan.preempted
    assert e in sched.waiting
    assert all(ch.seq is not e for ch in plan.chunks)


def test_only_running_sequence_without_room_preempts_itself():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=32)
    a = make_seq(0, 8, max_tokens=5)
    sched.add(a)
    step(sched)  # 8 computed + 1 sampled token, pool of 2 is full
    plan = sched.schedule()
    assert plan.preempted == [a]
    assert plan.chunks == []
    assert sched.waiting == [a] and sched.running == []


def test_preempted_sequence_is_recomputed_with_its_outputs_and_finishes_correctly():
    sched, a, b, c, d = preemption_setup()
    while sched.has_unfinished:
        step(sched)
    for s in (a, b, c, d):
        assert s.token_ids == expected_tokens(s.seq_id, s.token_ids[:3], 10)
    assert b.num_preemptions >= 1 and d.num_preemptions >= 1
    assert sched.kv_manager.pool.num_free_blocks == 4


def test_readmitted_sequence_reuses_its_cached_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32, max_num_seqs=4)
    a = make_seq(0, 7, max_tokens=20, arrival=0)
    b = make_seq(1, 7, max_tokens=20, arrival=1)
    sched.add(a)
    sched.add(b)
    step(sched)  # both 8 tokens, 7 computed, 2 blocks each
    step(sched)  # both 9 tokens, 8 computed: both blocks full and registered
    plan = sched.schedule()  # a needs a third block: b is preempted
    assert plan.preempted == [b]
    sched.advance(plan)
    for ch in plan.chunks:
        ch.seq.token_ids.append(fake_token(ch.seq.seq_id, ch.seq.num_tokens))
    sched.finish(a, FinishReason.ABORT)
    plan = sched.schedule()
    assert [ch.seq for ch in plan.chunks] == [b]
    # b's blocks were freed tail-first, so a's new block evicted b's second (tail) block and
    # only the first full block is still cached
    assert b.num_cached_prompt_tokens == 4
    assert plan.chunks[0].start == 4
    assert chunk_summary(plan) == [(1, 4, 5, True)]


def test_finish_of_a_waiting_sequence_removes_it():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.waiting == [b]
    sched.finish(b, FinishReason.ABORT)
    assert b.status is SequenceStatus.FINISHED
    assert b.finish_reason is FinishReason.ABORT
    assert sched.waiting == []
    assert sched.running == [a]


def test_finish_of_a_preempted_waiting_sequence_frees_nothing_twice():
    sched, a, b, c, d = preemption_setup()
    step(sched)
    sched.schedule()  # preempts d and b
    pool = sched.kv_manager.pool
    free_before = pool.num_free_blocks
    sched.finish(d, FinishReason.ABORT)
    assert d.is_finished and d not in sched.waiting
    assert pool.num_free_blocks == free_before


def test_finish_of_a_running_sequence_frees_its_blocks():
    sched = make_scheduler(num_blocks=8)
    a = make_seq(0, 9)
    sched.add(a)
    step(sched)
    assert sched.kv_manager.pool.num_free_blocks == 5
    sched.finish(a, FinishReason.STOP)
    assert sched.running == []
    assert a.block_table == [] and a.finish_reason is FinishReason.STOP
    assert sched.kv_manager.pool.num_free_blocks == 8
    assert not sched.has_unfinished


def test_finish_twice_is_a_no_op():
    sched = make_scheduler()
    a = make_seq(0, 4)
    sched.add(a)
    step(sched)
    sched.finish(a, FinishReason.STOP)
    sched.finish(a, FinishReason.ABORT)
    assert a.finish_reason is FinishReason.STOP
    assert sched.kv_manager.pool.num_free_blocks == sched.kv_manager.pool.num_blocks


def test_admission_follows_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1, budget=64)
    seqs = [
        make_seq(0, 3, max_tokens=1, priority=2, arrival=0),
        make_seq(1, 3, max_tokens=1, priority=0, arrival=1),
        make_seq(2, 3, max_tokens=1, priority=1, arrival=2),
        make_seq(3, 3, max_tokens=1, priority=0, arrival=3),
    ]
    for s in seqs:
        sched.add(s)
    order = []
    while sched.has_unfinished:
        order += [c.seq.seq_id for c in step(sched).chunks]
    assert order == [1, 3, 2, 0]


def test_important_sequence_sorts_ahead_in_running():
    sched = make_scheduler(max_num_seqs=4, budget=64)
    low = make_seq(0, 3, max_tokens=5, priority=5)
    sched.add(low)
    step(sched)
    high = make_seq(1, 3, max_tokens=5, priority=-1)
    sched.add(high)
    step(sched)
    assert sched.running == [high, low]


def test_prefix_hits_through_the_scheduler_skip_cached_tokens_and_count():
    sched = make_scheduler(num_blocks=32, block_size=4, budget=64)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    a = make_seq(0, prompt, max_tokens=3)
    sched.add(a)
    step(sched)
    b = make_seq(1, prompt, max_tokens=3)
    sched.add(b)
    plan = step(sched)
    assert chunk_summary(plan) == [(0, 10, 1, True), (1, 8, 2, True)]
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_prompt_tokens == 8
    kv = sched.kv_manager
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (20, 8)
    assert all(kv.pool.ref_counts[x] == 2 for x in a.block_table[:2])
    while sched.has_unfinished:
        step(sched)
    assert a.token_ids == expected_tokens(0, prompt, 3)
    assert b.token_ids == expected_tokens(1, prompt, 3)
    assert kv.pool.num_free_blocks == 32


def test_advance_marks_planned_tokens_computed():
    sched = make_scheduler(budget=8)
    a = make_seq(0, 20)
    sched.add(a)
    plan = sched.schedule()
    assert a.num_computed_tokens == 0
    sched.advance(plan)
    assert a.num_computed_tokens == 8
