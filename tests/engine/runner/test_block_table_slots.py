"""The persistent block table's bookkeeping (plain numpy): which slot each sequence holds across
steps, and which table entries a step must send so that every chunk's slot row starts with its blocks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenloom.engine.runner.block_table_slots import BlockTableSlots

WIDTH = 4


def plan(slots: BlockTableSlots, seq_ids: list[int], block_lists: list[list[int]]):
    """(slot of each chunk, [(flat index, block id)] sent), as the step buffers would use them."""
    slots_out = np.full(len(seq_ids), -1, dtype=np.int32)
    updates_out = np.zeros((len(seq_ids) * WIDTH, 2), dtype=np.int32)
    n = slots.plan(seq_ids, block_lists, slots_out, updates_out)
    return slots_out.tolist(), [tuple(u) for u in updates_out[:n].tolist()]


def test_a_new_sequence_sends_its_whole_row_and_an_unchanged_one_sends_nothing():
    s = BlockTableSlots(num_slots=4, max_blocks_per_seq=WIDTH)
    rows, updates = plan(s, [7], [[5, 2]])
    slot = rows[0]
    assert updates == [(slot * WIDTH, 5), (slot * WIDTH + 1, 2)]
    assert plan(s, [7], [[5, 2]]) == ([slot], [])


def test_a_grown_list_sends_only_its_new_tail():
    s = BlockTableSlots(num_slots=4, max_blocks_per_seq=WIDTH)
    (slot,), _ = plan(s, [7], [[5, 2]])
    assert plan(s, [7], [[5, 2, 9]]) == ([slot], [(slot * WIDTH + 2, 9)])


def test_a_list_that_is_not_an_extension_sends_the_whole_row():
    s = BlockTableSlots(num_slots=4, max_blocks_per_seq=WIDTH)
    (slot,), _ = plan(s, [7], [[5, 2]])
    assert plan(s, [7], [[3, 2, 1]]) == ([slot], [(slot * WIDTH, 3), (slot * WIDTH + 1, 2), (slot * WIDTH + 2, 1)])


def test_a_sequence_keeps_its_slot_while_others_come_and_go():
    s = BlockTableSlots(num_slots=4, max_blocks_per_seq=WIDTH)
    rows, _ = plan(s, [1, 2], [[0], [1]])
    slot_of_2 = rows[1]
    rows, _ = plan(s, [2, 3], [[1], [2]])  # 1 left, 3 came
    assert rows[0] == slot_of_2 and rows[1] != slot_of_2


def test_when_slots_run_out_a_sequence_absent_from_the_step_gives_up_its_slot_and_its_row_is_resent():
    s = BlockTableSlots(num_slots=2, max_blocks_per_seq=WIDTH)
    plan(s, [1, 2], [[0], [1]])
    rows, updates = plan(s, [2, 3], [[1], [2]])
    assert len(set(rows)) == 2
    assert updates == [(rows[1] * WIDTH, 2)]  # 2 kept its row; 3 took 1's
    rows, updates = plan(s, [1, 3], [[0], [2]])  # 1 is back: a fresh slot, its row sent again
    assert updates == [(rows[0] * WIDTH, 0)]


def test_more_blocks_than_a_row_holds_is_refused_before_anything_changes():
    s = BlockTableSlots(num_slots=2, max_blocks_per_seq=WIDTH)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        plan(s, [1, 2], [[0], [1, 2, 3, 4, 5]])
    rows, updates = plan(s, [1], [[0]])
    assert updates == [(rows[0] * WIDTH, 0)]


def test_replaying_the_updates_on_a_table_reproduces_every_step_s_rows():
    """Random steps (sequences arriving, leaving, growing, reallocated): a table that only ever
    receives the sent updates holds each chunk's blocks at the start of its slot row."""
    rng = random.Random(0)
    s = BlockTableSlots(num_slots=8, max_blocks_per_seq=WIDTH)
    table = np.full((8, WIDTH), -1, dtype=np.int32)
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        for seq_id in list(live):
            roll = rng.random()
            if roll < 0.15:
                del live[seq_id]
            elif roll < 0.45 and len(live[seq_id]) < WIDTH:
                live[seq_id] = live[seq_id] + [rng.randrange(100)]
            elif roll < 0.5:
                live[seq_id] = [rng.randrange(100) for _ in range(rng.randint(1, WIDTH))]
        while len(live) < 4 and rng.random() < 0.7:
            live[next_id] = [rng.randrange(100) for _ in range(rng.randint(1, WIDTH))]
            next_id += 1
        step = [i for i in live if rng.random() < 0.8]  # some sit the step out
        rows, updates = plan(s, step, [live[i] for i in step])
        for flat, block in updates:
            table.flat[flat] = block
        for seq_id, slot in zip(step, rows):
            assert table[slot, : len(live[seq_id])].tolist() == live[seq_id]
        assert len(set(rows)) == len(step)
