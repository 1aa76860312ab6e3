"""The CUDA step-input buffers' layout, checked on CPU tensors: offsets, dtypes, views of one
flat buffer, what one step fills and copies, the block table kept on the device across steps, and
the padding of decode steps for CUDA graphs."""

from __future__ import annotations

import torch

from tokenloom.engine.attention.metadata import ChunkContext
from tokenloom.engine.runner.copy_fence import NoCopyFence
from tokenloom.engine.runner.step_buffers import StepBuffers, StepLayout, StepLimits

LIMITS = StepLimits(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=3)


def buffers(fence=None) -> StepBuffers:
    return StepBuffers(LIMITS, torch.device("cpu"), fence or NoCopyFence(), pin_memory=False)


def test_sections_follow_each_other_int64_first_then_int32():
    layout = StepLayout(LIMITS)
    assert (layout.token_ids, layout.positions, layout.slot_mapping) == (0, 32 * 8, 64 * 8)
    assert layout.sample_indices == 96 * 8
    assert layout.query_start == 96 * 8 + 32 * 8  # a logit row per token: prompt scoring can need all
    assert layout.context_lens == layout.query_start + 5 * 4
    assert layout.table_slots == layout.context_lens + 4 * 4
    assert layout.table_updates == layout.table_slots + 4 * 4
    assert layout.total_bytes == layout.table_updates + 4 * 3 * 2 * 4  # every row rewritten, 2 int32 per entry
    assert layout.used_bytes(5) == layout.table_updates + 5 * 2 * 4


def test_every_view_shares_the_one_flat_buffer_with_its_dtype_and_shape():
    b = buffers()
    d = b.device
    assert d.token_ids.dtype == d.positions.dtype == d.slot_mapping.dtype == d.sample_indices.dtype == torch.int64
    assert d.query_start.dtype == d.context_lens.dtype == d.table_slots.dtype == d.table_updates.dtype == torch.int32
    assert d.table_updates.shape == (12, 2) and d.query_start.shape == (5,)
    assert b.block_table.shape == (4, 3) and b.slot_table.shape == (8, 3)  # twice the step's rows of slots
    base = b.device_flat.data_ptr()
    layout = b.layout
    assert d.slot_mapping.data_ptr() - base == layout.slot_mapping
    assert d.table_updates.data_ptr() - base == layout.table_updates
    assert b.host.context_lens.data_ptr() - b.host_flat.data_ptr() == layout.context_lens


def mixed_step():
    # A decode at position 5 (blocks [2, 0]), then a 3-token prefill chunk at positions 0..2 (block [1]).
    contexts = [ChunkContext(0, 1, 6, [2, 0], None), ChunkContext(1, 3, 3, [1], 4)]
    return dict(
        token_ids=[7, 8, 9, 10],
        positions=[5, 0, 1, 2],
        slots=[1, 4, 5, 6],
        sample_indices=[0, 3],
        contexts=contexts,
        seq_ids=[10, 11],
        num_decodes=1,
    )


def test_a_step_lands_in_the_device_views_with_its_varlen_tables():
    b = buffers()
    inputs = b.pack(**mixed_step())
    assert inputs.input_ids.tolist() == [7, 8, 9, 10]
    assert inputs.positions.tolist() == [5, 0, 1, 2]
    assert inputs.sample_indices.tolist() == [0, 3]
    meta = inputs.metadata
    assert meta.slot_mapping.tolist() == [1, 4, 5, 6] and meta.num_decodes == 1
    tables = meta.tables
    assert tables.query_start.tolist() == [0, 1, 4]
    assert tables.context_lens.tolist() == [6, 3]
    assert tables.block_table[0, :2].tolist() == [2, 0] and tables.block_table[1, 0].item() == 1
    assert tables.max_query_len == 3
    assert inputs.input_ids.data_ptr() == b.device.token_ids.data_ptr()  # a view, not a copy
    assert tables.block_table.data_ptr() == b.block_table.data_ptr()  # the graphs' fixed address


def test_only_the_bytes_up_to_the_last_table_update_of_the_step_are_copied():
    b = buffers()
    b.host_flat.fill_(0)
    b.device_flat.fill_(0xAB)
    b.pack(**mixed_step())
    used = b.layout.used_bytes(3)  # blocks [2, 0] and [1]: three new entries
    assert torch.equal(b.device_flat[:used], b.host_flat[:used])
    assert bool((b.device_flat[used:] == 0xAB).all())


def decode(query_start: int, context_len: int, blocks: list[int]) -> ChunkContext:
    return ChunkContext(query_start, 1, context_len, blocks, None)


def pack_decodes(b: StepBuffers, seq_ids: list[int], contexts: list[ChunkContext]):
    n = len(contexts)
    return b.pack(
        list(range(n)),
        [c.context_len - 1 for c in contexts],
        list(range(n)),
        list(range(n)),
        contexts,
        seq_ids,
        num_decodes=n,
    )


def test_a_decode_step_that_gains_no_block_copies_no_table_entry():
    b = buffers()
    pack_decodes(b, [1, 2], [decode(0, 5, [4, 7]), decode(1, 2, [3])])
    b.device_flat.fill_(0xAB)  # anything a step copies shows up
    inputs = pack_decodes(b, [1, 2], [decode(0, 6, [4, 7]), decode(1, 3, [3])])
    assert bool((b.device_flat[b.layout.used_bytes(0) :] == 0xAB).all())
    assert inputs.metadata.tables.block_table[0, :2].tolist() == [4, 7]
    assert inputs.metadata.tables.block_table[1, 0].item() == 3


def test_rows_follow_their_sequences_when_an_earlier_one_leaves_and_only_new_blocks_travel():
    b = buffers()
    pack_decodes(b, [1, 2, 3], [decode(0, 4, [9]), decode(1, 5, [4, 7]), decode(2, 2, [3])])
    # Sequence 1 finished: 2 and 3 move up a row; 3 gains a block, a new sequence 5 arrives.
    inputs = pack_decodes(b, [2, 3, 5], [decode(0, 6, [4, 7]), decode(1, 3, [3, 8]), decode(2, 1, [6])])
    updates = b.host.table_updates.tolist()
    assert [block for _, block in updates[:2]] == [8, 6]  # only the new block and the new row
    table = inputs.metadata.tables.block_table
    assert table[0, :2].tolist() == [4, 7] and table[1, :2].tolist() == [3, 8] and table[2, 0].item() == 6


def test_a_sequence_whose_blocks_changed_gets_its_whole_row_again():
    b = buffers()
    pack_decodes(b, [1], [decode(0, 5, [4, 7])])
    inputs = pack_decodes(b, [1], [decode(0, 5, [2, 5])])  # preempted and recomputed elsewhere
    assert inputs.metadata.tables.block_table[0, :2].tolist() == [2, 5]


def test_decodes_padded_to_a_graph_batch_size_write_nothing_and_attend_to_nothing():
    b = buffers()
    contexts = [ChunkContext(0, 1, 9, [1], None), ChunkContext(1, 1, 4, [0], None)]
    inputs = b.pack([3, 4], [8, 3], [24, 3], [0, 1], contexts, [5, 6], num_decodes=2, pad_to=4)
    assert inputs.input_ids.tolist() == [3, 4, 0, 0]
    assert inputs.metadata.slot_mapping.tolist() == [24, 3, -1, -1]  # -1: the KV write skips it
    assert inputs.sample_indices.tolist() == [0, 1, 2, 3]
    assert inputs.metadata.tables.query_start.tolist() == [0, 1, 2, 3, 4]
    assert inputs.metadata.tables.context_lens.tolist() == [9, 4, 0, 0]
    assert inputs.metadata.num_decodes == 4


def test_the_host_buffer_is_refilled_only_after_waiting_for_the_previous_copy():
    log: list[str] = []

    class Fence:
        def record(self):
            log.append("record")

        def wait(self):
            log.append("wait")

    b = buffers(Fence())
    b.pack(**mixed_step())
    b.pack(**mixed_step())
    assert log == ["wait", "record", "wait", "record"]
