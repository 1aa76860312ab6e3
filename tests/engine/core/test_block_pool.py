"""Tests for engine/core/block_pool.py: ref counts, LRU free list and the prefix-cache index."""

import pytest

from tokenloom.engine.core.block_pool import BlockPool


def key(*tokens, parent=None):
    return (parent, tuple(tokens))


# --- allocate / free ----------------------------------------------------------------------


def test_num_blocks_below_one_is_rejected():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_new_pool_has_every_block_free_with_zero_refs():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 0
    assert pool.ref_counts == [0] * 5
    assert all(pool.is_free(b) for b in range(5))


def test_allocate_sets_ref_count_one_and_removes_block_from_free_list():
    pool = BlockPool(3)
    b = pool.allocate()
    assert pool.ref_counts[b] == 1
    assert not pool.is_free(b)
    assert pool.num_free_blocks == 2
    assert pool.num_used_blocks == 1


def test_allocate_hands_out_distinct_blocks_until_exhausted():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0


def test_free_drops_one_reference_and_returns_block_at_zero():
    pool = BlockPool(3)
    b = pool.allocate()
    pool.share(b)
    assert pool.ref_counts[b] == 2
    pool.free([b])
    assert pool.ref_counts[b] == 1
    assert not pool.is_free(b)
    pool.free([b])
    assert pool.ref_counts[b] == 0
    assert pool.is_free(b)
    assert pool.num_free_blocks == 3


def test_freeing_a_block_more_often_than_allocated_raises():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])
    assert pool.ref_counts[b] == 0
    assert pool.num_free_blocks == 2


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.free([1])


# --- LRU free list ------------------------------------------------------------------------


def test_least_recently_freed_block_is_allocated_first():
    pool = BlockPool(4)
    a, b, c, d = (pool.allocate() for _ in range(4))
    pool.free([b])
    pool.free([d])
    pool.free([a])
    pool.free([c])
    assert [pool.allocate() for _ in range(4)] == [b, d, a, c]


def test_blocks_of_one_free_call_are_freed_tail_first():
    pool = BlockPool(4)
    a, b, c, d = (pool.allocate() for _ in range(4))
    pool.free([a, b, c])  # freed in order c, b, a
    pool.free([d])
    assert [pool.allocate() for _ in range(4)] == [c, b, a, d]


def test_initial_free_list_is_in_block_id_order():
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]


# --- prefix-cache index -------------------------------------------------------------------


def test_registered_block_is_found_by_lookup():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.register(b, key(1, 2))
    assert pool.lookup(key(1, 2)) == b
    assert pool.block_keys[b] == key(1, 2)
    assert pool.lookup(key(1, 3)) is None


def test_freed_block_with_key_stays_findable_until_reallocated():
    pool = BlockPool(3)
    b = pool.allocate()  # block 0
    pool.register(b, key(7))
    pool.free([b])
    assert pool.is_free(b)
    assert pool.lookup(key(7)) == b
    # the two never-used blocks sit before it in the free list
    assert pool.allocate() != b
    assert pool.allocate() != b
    assert pool.lookup(key(7)) == b
    assert pool.allocate() == b  # evicted now
    assert pool.lookup(key(7)) is None
    assert pool.block_keys[b] is None
    assert key(7) not in pool.cached_blocks


def test_share_revives_a_free_cached_block_and_removes_it_from_free_list():
    pool = BlockPool(3)
    b = pool.allocate()
    pool.register(b, key(1))
    pool.free([b])
    free_before = pool.num_free_blocks
    pool.share(b)
    assert pool.ref_counts[b] == 1
    assert not pool.is_free(b)
    assert pool.num_free_blocks == free_before - 1
    assert pool.lookup(key(1)) == b  # still cached
    others = [pool.allocate() for _ in range(pool.num_free_blocks)]
    assert b not in others
    assert pool.lookup(key(1)) == b


def test_share_of_a_used_block_only_adds_a_reference():
    pool = BlockPool(3)
    b = pool.allocate()
    free_before = pool.num_free_blocks
    pool.share(b)
    pool.share(b)
    assert pool.ref_counts[b] == 3
    assert pool.num_free_blocks == free_before


def test_revived_block_freed_again_goes_to_the_tail_of_the_free_list():
    pool = BlockPool(3)
    b = pool.allocate()  # 0; free list [1, 2]
    pool.register(b, key(1))
    pool.free([b])  # [1, 2, 0]
    pool.share(b)  # [1, 2]
    pool.free([b])  # [1, 2, 0]
    assert [pool.allocate() for _ in range(3)] == [1, 2, b]


def test_register_first_writer_wins_for_the_same_key():
    pool = BlockPool(3)
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, key(4, 5))
    pool.register(second, key(4, 5))
    assert pool.lookup(key(4, 5)) == first
    assert pool.block_keys[second] is None
    assert pool.cached_blocks == {key(4, 5): first}


def test_register_keeps_a_blocks_first_key():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.register(b, key(1))
    pool.register(b, key(2))
    assert pool.block_keys[b] == key(1)
    assert pool.lookup(key(1)) == b
    assert pool.lookup(key(2)) is None


def test_key_can_be_registered_again_after_its_block_was_evicted():
    pool = BlockPool(1)
    b = pool.allocate()
    pool.register(b, key(1))
    pool.free([b])
    b2 = pool.allocate()  # evicts key(1)
    assert pool.lookup(key(1)) is None
    pool.register(b2, key(1))
    assert pool.lookup(key(1)) == b2


def test_prefix_caching_disabled_lookup_always_misses():
    pool = BlockPool(2, enable_prefix_caching=False)
    b = pool.allocate()
    pool.register(b, key(1))
    assert pool.lookup(key(1)) is None
    assert pool.block_keys[b] is None
    assert pool.cached_blocks == {}
    pool.free([b])
    assert pool.lookup(key(1)) is None
