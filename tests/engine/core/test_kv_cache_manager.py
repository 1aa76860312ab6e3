"""Tests for engine/core/kv_cache_manager.py: slot allocation and automatic prefix caching."""

from tests.engine.sequences import make_seq
from tokenloom.engine.core.block_pool import BlockPool
from tokenloom.engine.core.kv_cache_manager import KVCacheManager

BS = 4


def make_manager(num_blocks=16, block_size=BS, enable_prefix_caching=True):
    return KVCacheManager(BlockPool(num_blocks, enable_prefix_caching), block_size)


def compute_all(kv, seq):
    """What a forward pass over the whole sequence does: allocate, mark computed, register."""
    hits = kv.find_cached_prefix(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - len(hits) * kv.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return hits


def admit(kv, seq):
    """Admission as the scheduler does it (whole remainder, no budget)."""
    hits = kv.find_cached_prefix(seq)
    ok = kv.allocate_slots(seq, seq.num_tokens - len(hits) * kv.block_size, hits)
    return hits, ok


A = list(range(100, 104))  # one full block of tokens each
B = list(range(200, 204))
C = list(range(300, 304))
D = list(range(400, 404))


# --- slot allocation ----------------------------------------------------------------------


def test_blocks_needed_is_ceil_of_tokens_over_block_size():
    kv = make_manager()
    assert [kv.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_slots_takes_ceil_tokens_over_block_size_blocks():
    kv = make_manager(num_blocks=10)
    seq = make_seq(1, 9)
    assert kv.allocate_slots(seq, 9)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert all(kv.pool.ref_counts[b] == 1 for b in seq.block_table)
    assert kv.pool.num_free_blocks == 7
    assert seq.num_computed_tokens == 0  # allocation does not mark anything computed


def test_allocate_slots_only_adds_blocks_for_tokens_past_the_table():
    kv = make_manager(num_blocks=10)
    seq = make_seq(1, 9)
    assert kv.allocate_slots(seq, 9)
    seq.num_computed_tokens = 9
    table = list(seq.block_table)
    assert kv.allocate_slots(seq, 3)  # 12 tokens: still 3 blocks
    assert seq.block_table == table
    assert kv.allocate_slots(seq, 4)  # 13 tokens: 4 blocks
    assert seq.block_table[:3] == table
    assert len(seq.block_table) == 4


def test_allocate_slots_returns_false_and_changes_nothing_when_pool_is_short():
    kv = make_manager(num_blocks=2)
    seq = make_seq(1, 9)
    assert not kv.allocate_slots(seq, 9)
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert kv.pool.num_free_blocks == 2
    assert kv.pool.ref_counts == [0, 0]


def test_allocate_slots_exactly_fitting_the_free_blocks_succeeds():
    kv = make_manager(num_blocks=2)
    seq = make_seq(1, 8)
    assert kv.allocate_slots(seq, 8)
    assert kv.pool.num_free_blocks == 0


def test_allocate_slots_short_with_cached_hits_changes_nothing():
    kv = make_manager(num_blocks=3)
    first = make_seq(1, A + B + [1])
    compute_all(kv, first)  # 3 blocks, first two registered
    kv.free(first)
    # hits: 2 revived blocks + needs 2 more for C + D + [9]: 4 > 3 free
    seq = make_seq(2, A + B + C + D + [9])
    hits = kv.find_cached_prefix(seq)
    assert len(hits) == 2
    refs, free = list(kv.pool.ref_counts), kv.pool.num_free_blocks
    assert not kv.allocate_slots(seq, seq.num_tokens - 2 * BS, hits)
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert kv.pool.ref_counts == refs
    assert kv.pool.num_free_blocks == free
    assert all(kv.pool.is_free(b) for b in hits)


def test_revived_cached_blocks_count_against_free_blocks():
    kv = make_manager(num_blocks=3)
    first = make_seq(1, A + B + [1])
    compute_all(kv, first)
    kv.free(first)
    seq = make_seq(2, A + B + C + [9])  # 2 revived + 2 new = 4 > 3
    hits, ok = admit(kv, seq)
    assert len(hits) == 2
    assert not ok
    seq2 = make_seq(3, A + B + [7])  # 2 revived + 1 new = 3
    hits, ok = admit(kv, seq2)
    assert ok
    assert kv.pool.num_free_blocks == 0


# --- prefix caching -----------------------------------------------------------------------


def test_second_sequence_with_same_two_full_blocks_shares_them():
    kv = make_manager()
    first = make_seq(1, A + B + [1, 2, 3])
    compute_all(kv, first)
    second = make_seq(2, A + B + [5, 6])
    hits, ok = admit(kv, second)
    assert ok
    assert hits == first.block_table[:2]
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] not in first.block_table
    assert len(second.block_table) == 3
    assert [kv.pool.ref_counts[b] for b in second.block_table[:2]] == [2, 2]
    assert kv.pool.ref_counts[second.block_table[2]] == 1
    assert second.num_computed_tokens == 2 * BS


def test_prefix_hits_stop_at_the_first_mismatching_block():
    kv = make_manager()
    first = make_seq(1, A + B + C + [1])
    compute_all(kv, first)
    second = make_seq(2, A + D + C + [1])
    hits, ok = admit(kv, second)
    assert ok
    assert hits == first.block_table[:1]
    assert second.num_computed_tokens == BS


def test_prompt_of_exactly_n_cached_full_blocks_recomputes_its_last_block():
    kv = make_manager()
    first = make_seq(1, A + B + C)
    compute_all(kv, first)
    assert all(kv.pool.block_keys[b] is not None for b in first.block_table)
    second = make_seq(2, A + B + C)
    hits = kv.find_cached_prefix(second)
    assert hits == first.block_table[:2]  # N - 1 of N
    assert kv.allocate_slots(second, second.num_tokens - len(hits) * BS, hits)
    assert second.num_computed_tokens == 2 * BS < second.num_tokens
    assert second.block_table[2] != first.block_table[2]


def test_single_full_block_prompt_gets_no_hit():
    kv = make_manager()
    compute_all(kv, make_seq(1, A + B))
    assert kv.find_cached_prefix(make_seq(2, A)) == []


def test_different_first_block_means_no_hits_for_identical_later_blocks():
    kv = make_manager()
    first = make_seq(1, A + B + C + [1])
    compute_all(kv, first)
    second = make_seq(2, D + B + C + [1])
    assert kv.find_cached_prefix(second) == []
    # the later blocks are cached, but only under a key chained to A's hash
    assert kv.pool.lookup((None, tuple(B))) is None


def test_partial_blocks_are_not_registered():
    kv = make_manager()
    first = make_seq(1, A + [1, 2])
    compute_all(kv, first)
    assert kv.pool.block_keys[first.block_table[0]] is not None
    assert kv.pool.block_keys[first.block_table[1]] is None


def test_cache_full_blocks_registers_blocks_as_they_fill():
    kv = make_manager()
    seq = make_seq(1, A + B + C + [1])
    assert kv.allocate_slots(seq, 6)
    seq.num_computed_tokens = 6
    kv.cache_full_blocks(seq)
    assert kv.pool.block_keys[seq.block_table[0]] is not None
    assert kv.pool.block_keys[seq.block_table[1]] is None
    assert kv.allocate_slots(seq, seq.num_tokens - 6)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    assert [kv.pool.block_keys[b] is not None for b in seq.block_table] == [True, True, True, False]
    probe = make_seq(2, A + B + C + [5])
    assert kv.find_cached_prefix(probe) == seq.block_table[:3]


def test_identical_block_computed_twice_keeps_the_first_copy():
    kv = make_manager()
    first = make_seq(1, A + B + [1])
    second = make_seq(2, A + B + [2])
    # both computed without sharing (e.g. admitted in the same step)
    for seq in (first, second):
        assert kv.allocate_slots(seq, seq.num_tokens)
    for seq in (first, second):
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
    assert kv.find_cached_prefix(make_seq(3, A + B + [3])) == first.block_table[:2]
    assert all(kv.pool.block_keys[b] is None for b in second.block_table)


def test_free_returns_blocks_and_resets_the_sequence():
    kv = make_manager(num_blocks=8)
    seq = make_seq(1, A + B + [1])
    compute_all(kv, seq)
    blocks = list(seq.block_table)
    kv.free(seq)
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert kv.pool.num_free_blocks == 8
    assert all(kv.pool.ref_counts[b] == 0 and kv.pool.is_free(b) for b in blocks)


def test_freed_cached_blocks_are_revived_by_a_later_hit():
    kv = make_manager(num_blocks=8)
    first = make_seq(1, A + B + [1])
    compute_all(kv, first)
    cached = first.block_table[:2]
    kv.free(first)
    second = make_seq(2, A + B + C)
    hits, ok = admit(kv, second)
    assert ok
    assert hits == cached
    assert second.block_table[:2] == cached
    assert all(kv.pool.ref_counts[b] == 1 and not kv.pool.is_free(b) for b in cached)
    assert second.num_computed_tokens == 2 * BS
    assert kv.pool.num_free_blocks == 8 - 3


def test_preempted_sequence_rehits_its_own_blocks_including_output_tokens():
    kv = make_manager(num_blocks=8)
    seq = make_seq(1, A + [1, 2])
    compute_all(kv, seq)
    seq.token_ids += [3, 4, 5]  # generated tokens fill block 1
    assert kv.allocate_slots(seq, 3)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    blocks = list(seq.block_table)
    kv.free(seq)  # preemption
    hits, ok = admit(kv, seq)
    assert ok
    assert hits == blocks[:2]
    assert seq.num_computed_tokens == 2 * BS


def test_evicted_block_is_no_longer_a_hit():
    kv = make_manager(num_blocks=2)
    first = make_seq(1, A + [1])
    compute_all(kv, first)
    kv.free(first)  # block 1 (tail) freed first, then block 0
    other = make_seq(2, 8)
    assert kv.allocate_slots(other, 8)  # takes both blocks, evicting A's
    assert kv.find_cached_prefix(make_seq(3, A + [2])) == []


def test_shared_block_is_freed_only_when_all_holders_free_it():
    kv = make_manager(num_blocks=8)
    first = make_seq(1, A + B + [1])
    compute_all(kv, first)
    second = make_seq(2, A + B + [2])
    admit(kv, second)
    shared = first.block_table[:2]
    kv.free(first)
    assert all(kv.pool.ref_counts[b] == 1 and not kv.pool.is_free(b) for b in shared)
    kv.free(second)
    assert all(kv.pool.ref_counts[b] == 0 and kv.pool.is_free(b) for b in shared)
    assert kv.pool.num_free_blocks == 8


def test_prefix_caching_disabled_gives_no_hits():
    kv = make_manager(enable_prefix_caching=False)
    first = make_seq(1, A + B + [1])
    compute_all(kv, first)
    assert all(kv.pool.block_keys[b] is None for b in first.block_table)
    assert kv.find_cached_prefix(make_seq(2, A + B + [1])) == []


# --- counters -----------------------------------------------------------------------------


def test_record_prefix_lookup_accumulates_queries_and_hits():
    kv = make_manager()
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)
    kv.record_prefix_lookup(10, 0)
    kv.record_prefix_lookup(9, 8)
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (19, 8)


def test_find_and_allocate_do_not_touch_the_counters():
    kv = make_manager()
    compute_all(kv, make_seq(1, A + B + [1]))
    admit(kv, make_seq(2, A + B + [2]))
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)


# --- contiguous placement (used by the torch attention backend) -----------------------------


def test_sequences_started_together_get_disjoint_runs_and_grow_in_place():
    manager = KVCacheManager(BlockPool(64, prefer_contiguous=True), block_size=4)
    a, b = make_seq(1, 6, max_tokens=10), make_seq(2, 5, max_tokens=3)
    assert manager.allocate_slots(a, 6) and manager.allocate_slots(b, 5)
    assert a.block_table == [0, 1] and b.block_table == [4, 5]  # a reserved room for 16 tokens
    a.num_computed_tokens = 6
    assert manager.allocate_slots(a, 6)  # grows to 12 tokens: the next two blocks in place
    assert a.block_table == [0, 1, 2]


def test_contiguous_placement_falls_back_to_any_free_block_when_fragmented():
    pool = BlockPool(6, prefer_contiguous=True)
    manager = KVCacheManager(pool, block_size=4)
    holders = [make_seq(i, 4, max_tokens=1) for i in range(6)]
    for seq in holders:
        assert manager.allocate_slots(seq, 4)
    for seq in holders:
        if seq.block_table[0] % 2 == 0:
            manager.free(seq)  # frees blocks 0, 2 and 4: no two free blocks are adjacent
    freed = [0, 2, 4]
    big = make_seq(9, 12, max_tokens=1)
    assert manager.allocate_slots(big, 12)
    assert sorted(big.block_table) == freed


def test_find_free_run_is_off_without_prefer_contiguous():
    assert BlockPool(8).find_free_run(2) is None
