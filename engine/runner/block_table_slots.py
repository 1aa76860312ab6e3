"""Which row (slot) of the persistent device block table holds each sequence, and what a step changes.

Why: from one decode step to the next a sequence's block list changes only when it gains a block,
once every block_size tokens. Rebuilding every chunk's row on the host and copying the whole
[num_chunks, max_blocks] table each step costs host time and copy bytes in proportion to the
total context of the batch. Instead each sequence keeps a slot of a device-side table across
steps; a step sends only the entries that changed, as (flat index, block id) pairs that the device
scatters into the table, plus each chunk's slot, through which the device gathers the step's table.

Rows follow sequences, not a chunk's position in the step: when a sequence finishes, the chunks
after it move up a row, but their slots stay put.

What a slot holds is checked by content rather than trusted from the sequence's lifecycle: a slot
remembers the block list it last sent. A list that extends it sends its new tail; any other change
(the sequence was preempted and got new blocks) sends the whole row. A sequence that leaves keeps
its slot until a new one needs it; with at least as many slots beyond the step's largest chunk
count, a step always finds one free.

Plain Python and numpy: the device work (one scatter, one gather) is the step buffers'.
"""

from __future__ import annotations

import numpy as np


class BlockTableSlots:
    def __init__(self, num_slots: int, max_blocks_per_seq: int):
        self.num_slots = num_slots
        self.max_blocks_per_seq = max_blocks_per_seq  # a slot's width
        self._slot_of: dict[int, int] = {}  # seq id -> slot
        self._owner: list[int | None] = [None] * num_slots  # slot -> seq id
        self._sent: list[list[int]] = [[] for _ in range(num_slots)]  # slot -> the blocks its device row holds

    def plan(
        self, seq_ids: list[int], block_lists: list[list[int]], slots_out: np.ndarray, updates_out: np.ndarray
    ) -> int:
        """Write each chunk's slot to `slots_out` [num_chunks] and the table entries that changed to
        `updates_out` [n, 2] as (slot * max_blocks_per_seq + column, block id); return n.

        Applying the updates to the device table makes its row `slots_out[i]` begin with
        `block_lists[i]` for every chunk i."""
        width = self.max_blocks_per_seq
        longest = max(map(len, block_lists), default=0)
        if longest > width:  # checked before any state changes, so a refused step leaves none
            raise ValueError(
                f"a chunk has {longest} context blocks but the block table holds {width} per "
                f"sequence: raise max_blocks_per_seq (max_model_len / block_size) in StepLimits"
            )
        slots = self._assign(seq_ids)
        slots_out[: len(slots)] = slots
        num_updates = 0
        for slot, blocks in zip(slots, block_lists):
            sent = self._sent[slot]
            num_sent = len(sent)
            if len(blocks) == num_sent and blocks == sent:
                continue  # the common decode step: nothing new
            first = num_sent if len(blocks) > num_sent and blocks[:num_sent] == sent else 0
            end = num_updates + len(blocks) - first
            base = slot * width
            updates_out[num_updates:end, 0] = np.arange(base + first, base + len(blocks))
            updates_out[num_updates:end, 1] = blocks[first:]
            num_updates = end
            self._sent[slot] = list(blocks)  # a copy: the caller may reuse its list
        return num_updates

    def _assign(self, seq_ids: list[int]) -> list[int]:
        """Each sequence's slot, giving one to the sequences that have none."""
        missing = list(dict.fromkeys(s for s in seq_ids if s not in self._slot_of))  # once each
        if missing:
            self._take_slots(missing, set(seq_ids))
        return [self._slot_of[s] for s in seq_ids]

    def _take_slots(self, seq_ids: list[int], in_step: set[int]) -> None:
        """A slot for each of `seq_ids` among those no sequence of the step holds, unowned ones first."""
        owners = self._owner
        free = [s for s, owner in enumerate(owners) if owner is None]
        free += [s for s, owner in enumerate(owners) if owner is not None and owner not in in_step]
        if len(free) < len(seq_ids):
            raise ValueError(
                f"{len(in_step)} sequences in one step but the block table has {self.num_slots} "
                f"slots: StepLimits.num_table_slots must be at least max_num_seqs"
            )
        for seq_id, slot in zip(seq_ids, free):
            previous = owners[slot]
            if previous is not None:
                del self._slot_of[previous]
            owners[slot] = seq_id
            self._slot_of[seq_id] = slot
            self._sent[slot] = []
