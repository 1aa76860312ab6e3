"""Continuous batching: which tokens of which sequences go into the next forward pass.

Plain Python (no torch). The scheduler only plans; the engine runs the plan, appends sampled
tokens and reports finished sequences back through `finish()`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tokenloom.engine.core.kv_cache_manager import KVCacheManager
from tokenloom.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from tokenloom.engine.core.swap_space import SwapSpace


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, from position `start`, computed in this step."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool  # the chunk reaches the last token of a sequence that generates, so its logits are sampled

    @property
    def completes(self) -> bool:
        """The chunk reaches the sequence's last token (sampled, or the end of a score-only prompt)."""
        return self.end == self.seq.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The contract between scheduler and model runner for one step.

    chunks: what to compute, single-token chunks (decodes) first so an attention backend can
        batch them; every chunk's blocks are already allocated in `seq.block_table`.
    preempted: sequences that lost their blocks this step (swapped out, or back to the waiting
        queue to be recomputed).
    swap_out: (device block, host block) copies to make BEFORE the forward pass (those device
        blocks may be rewritten by it); swap_in: (host block, device block) copies, likewise.
        One step has swap-outs or swap-ins, never both.
    """

    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, swap: SwapSpace | None = None
    ):
        self.kv_manager = kv_manager
        self.swap = swap
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key
        self.swapped: list[Sequence] = []  # sorted by Sequence.sort_key
        self.num_preemptions = 0
        self.num_swap_outs = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """Plan one step.

        1. Running sequences, most important first, each get their remaining tokens (one for a
           decode, the rest of the prompt for a chunked prefill) within the token budget. When the
           pool has no block for one of them, the least important running sequence is preempted
           until it fits: its KV is swapped out to host memory when the swap space has room
           (resumed later without recompute), else its blocks are freed and it is recomputed.
        2. If nothing was preempted, swapped sequences come back first (most important first),
           then waiting sequences are admitted in order while the budget,
           `max_num_seqs` and free blocks allow, reusing prefix-cache hits; a prompt larger than
           the leftover budget is split and continues next step (chunked prefill).
        """
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.kv_manager.allocate_slots(seq, num_tokens):
                victim = self.running.pop()
                swap_out.extend(self._preempt(victim))
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chunks.append(self._chunk(seq, num_tokens))
                budget -= num_tokens
                index += 1
                continue
            break  # `seq` itself was preempted: everything after it already was

        while not preempted and self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            pairs = self.kv_manager.swap_in(seq, self.swap, num_tokens)
            if pairs is None:
                break
            allocated = self.kv_manager.allocate_slots(seq, num_tokens)
            assert allocated, "swap_in checked the room for the new tokens too"
            self.swapped.pop(0)
            swap_in.extend(pairs)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            chunks.append(self._chunk(seq, num_tokens))
            budget -= num_tokens

        while (
            not preempted and not self.swapped and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            cached_blocks = self.kv_manager.find_cached_prefix(seq)
            num_cached = len(cached_blocks) * self.kv_manager.block_size
            num_tokens = min(seq.num_tokens - num_cached, budget)
            if not self.kv_manager.allocate_slots(seq, num_tokens, cached_blocks):
                break
            self.waiting.pop(0)
            self.kv_manager.record_prefix_lookup(seq.num_tokens, num_cached)
            seq.num_cached_prompt_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            chunks.append(self._chunk(seq, num_tokens))
            budget -= num_tokens

        chunks.sort(key=lambda c: c.num_tokens != 1)  # stable: decodes first
        return SchedulerOutput(chunks=chunks, preempted=preempted, swap_out=swap_out, swap_in=swap_in)

    def advance(self, output: SchedulerOutput) -> None:
        """Mark the planned tokens as computed once the forward pass has run."""
        for chunk in output.chunks:
            chunk.seq.num_computed_tokens = chunk.end
            self.kv_manager.cache_full_blocks(chunk.seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            assert self.swap is not None  # a sequence is swapped out only where there is swap space
            self.swapped.remove(seq)
            self.swap.free(seq.host_block_table)
            seq.host_block_table = []
        else:
            self.waiting.remove(seq)
        self.kv_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, num_tokens, samples=start + num_tokens == seq.num_tokens and seq.generates)

    def _preempt(self, seq: Sequence) -> list[tuple[int, int]]:
        """Take `seq`'s blocks away: swap its KV out if there is room, else free them to recompute."""
        seq.num_preemptions += 1
        self.num_preemptions += 1
        pairs = self.kv_manager.swap_out(seq, self.swap) if self.swap is not None else None
        if pairs is not None:
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_sort_key)
            return pairs
        self.kv_manager.free(seq)
        self.add(seq)
        return []


def _sort_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.sort_key
