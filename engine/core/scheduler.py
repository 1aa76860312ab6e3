"""Continuous batching: which tokens of which sequences go into the next forward pass.

Plain Python (no torch). The scheduler only plans; the engine runs the plan, appends sampled
tokens and reports finished sequences back through `finish()`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import partial

from tokenloom.engine.core.kv_cache_manager import KVCacheManager
from tokenloom.engine.core.priority_preemption import Room, Victim, lower_priority_tail, num_victims_needed
from tokenloom.engine.core.seat_share import SeatShare
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


@dataclass(slots=True)
class _StepDraft:
    """The step's plan while `Scheduler.schedule()` builds it."""

    budget: int  # tokens left
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.budget -= chunk.num_tokens

    def planned_tokens(self, seq: Sequence) -> int:
        return next((c.num_tokens for c in self.chunks if c.seq is seq), 0)

    def drop(self, seq: Sequence) -> None:
        """Take `seq`'s chunk (if any) out of the step and give its tokens back to the budget.
        Blocks allocated for it stay in its table and serve the same tokens next step."""
        self.budget += self.planned_tokens(seq)
        self.chunks = [c for c in self.chunks if c.seq is not seq]


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        swap: SwapSpace | None = None,
        guaranteed_seats_per_class: int = 0,
    ):
        self.kv_manager = kv_manager
        self.swap = swap
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key
        self.swapped: list[Sequence] = []  # sorted by Sequence.sort_key
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of which made way for a more important pending sequence
        self.num_swap_outs = 0
        self.seats = SeatShare(guaranteed_seats_per_class)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)
        self.seats.pending_added(seq)

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
        2. If nothing was preempted, pending sequences (swapped and waiting, one queue by priority,
           swapped first among equals) are admitted in order while the budget, `max_num_seqs` and
           free blocks allow, reusing prefix-cache hits; a prompt larger than the leftover budget
           is split and continues next step (chunked prefill). The first that does not fit stops
           admission, so a large prompt is not overtaken by later small ones. A seat class held
           below its guaranteed seats is served first (engine/core/seat_share.py).
        3. A pending sequence of strictly better priority than the worst running one still gets
           in: running sequences of strictly worse priority are preempted, worst first and only as
           many as it needs (engine/core/priority_preemption.py) and never below another class's
           guaranteed seats, and their chunks of this step
           are dropped; when only the budget is short, a worse sequence's chunk is deferred to the
           next step instead. One step swaps one way only: a swapped sequence waits a step after
           swap-outs, and victims are recomputed in a step that swaps in.
        """
        draft = _StepDraft(budget=self.max_num_batched_tokens)
        self._schedule_running(draft)
        if not draft.preempted:
            while draft.budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self._next_pending(serve_starved=True)
                if seq is None or not self._admit(seq, draft):
                    break
        self._admit_over_lower_priority(draft)
        draft.chunks.sort(key=lambda c: c.num_tokens != 1)  # stable: decodes first
        return SchedulerOutput(draft.chunks, draft.preempted, draft.swap_out, draft.swap_in)

    def _schedule_running(self, draft: _StepDraft) -> None:
        index = 0
        while index < len(self.running) and draft.budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, draft.budget)
            while not self.kv_manager.allocate_slots(seq, num_tokens):
                victim = self.running.pop()
                self.seats.running_removed(victim)
                draft.swap_out.extend(self._preempt(victim))
                draft.preempted.append(victim)
                if victim is seq:
                    return  # everything after `seq` was preempted before it
            draft.add(self._chunk(seq, num_tokens))
            index += 1

    def _next_pending(self, serve_starved: bool = False) -> Sequence | None:
        """The pending sequence to admit next: the first by priority, or with `serve_starved`, the first
        of a class held below its guaranteed seats (engine/core/seat_share.py)."""
        starved = self.seats.starved_classes() if serve_starved else set()
        if starved:
            # Each queue is sorted, so a class's first entry in it is its best there.
            firsts = [
                next((s for s in queue if s.seat_class in starved), None) for queue in (self.swapped, self.waiting)
            ]
            return min((s for s in firsts if s is not None), key=_admission_key)
        heads = [queue[0] for queue in (self.swapped, self.waiting) if queue]
        return min(heads, key=_admission_key, default=None)

    def _admit(self, seq: Sequence, draft: _StepDraft) -> bool:
        """Move the pending `seq` to running with a chunk in `draft`; False (no change) if the pool is short."""
        if seq.status is SequenceStatus.SWAPPED:
            assert self.swap is not None  # a sequence is swapped out only where there is swap space
            num_tokens = min(seq.num_uncomputed_tokens, draft.budget)
            pairs = self.kv_manager.swap_in(seq, self.swap, num_tokens)
            if pairs is None:
                return False
            allocated = self.kv_manager.allocate_slots(seq, num_tokens)
            assert allocated, "swap_in checked the room for the new tokens too"
            self.swapped.remove(seq)
            draft.swap_in.extend(pairs)
            self.seats.pending_removed(seq)
        else:
            cached_blocks = self.kv_manager.find_cached_prefix(seq)
            num_cached = len(cached_blocks) * self.kv_manager.block_size
            num_tokens = min(seq.num_tokens - num_cached, draft.budget)
            if not self.kv_manager.allocate_slots(seq, num_tokens, cached_blocks):
                return False
            self.waiting.remove(seq)
            self.seats.pending_removed(seq)
            self.kv_manager.record_prefix_lookup(seq.num_tokens, num_cached)
            seq.num_cached_prompt_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_sort_key)
        self.seats.running_added(seq)
        draft.add(self._chunk(seq, num_tokens))
        return True

    def _admit_over_lower_priority(self, draft: _StepDraft) -> None:
        """Step 3 of `schedule()`: pending sequences more important than the worst running one."""
        deferred: list[ScheduledChunk] = []
        while (seq := self._next_pending()) is not None:
            # Another class's guaranteed seats are never taken (engine/core/seat_share.py).
            tail = self.seats.preemptible(lower_priority_tail(self.running, seq), seq.seat_class)
            if not tail or not self._defer_for_budget(draft, tail, deferred):
                break
            victims = [Victim(v, self.kv_manager.num_releasable_blocks(v), draft.planned_tokens(v)) for v in tail]
            room = Room(self.max_num_seqs - len(self.running), self.kv_manager.pool.num_free_blocks, draft.budget)
            num_victims = num_victims_needed(room, victims, partial(self.kv_manager.num_blocks_to_admit, seq))
            if num_victims is None:
                break
            for victim in tail[:num_victims]:
                self.running.remove(victim)
                self.seats.running_removed(victim)
                draft.drop(victim)
                draft.swap_out.extend(self._preempt(victim, may_swap=not draft.swap_in))
                draft.preempted.append(victim)
                self.num_priority_preemptions += 1
            if seq.status is SequenceStatus.SWAPPED and draft.swap_out:
                break  # it swaps in next step, into the room made now
            if not self._admit(seq, draft):
                break  # shared prefix blocks made the estimate short; it is first in line next step
        # A deferred sequence takes what budget is left, up to its dropped chunk (which its blocks cover).
        for chunk in deferred:
            if chunk.seq.status is SequenceStatus.RUNNING and draft.budget > 0:
                draft.add(self._chunk(chunk.seq, min(chunk.num_tokens, draft.budget)))

    def _defer_for_budget(self, draft: _StepDraft, tail: list[Sequence], deferred: list[ScheduledChunk]) -> bool:
        """When the budget is spent, drop the last chunk of a sequence in `tail` until some is
        back: deferring a chunk costs nothing, preempting for budget would. False if none is left."""
        tail_ids = {id(seq) for seq in tail}
        while draft.budget == 0:
            chunk = next((c for c in reversed(draft.chunks) if id(c.seq) in tail_ids), None)
            if chunk is None:
                return False
            draft.drop(chunk.seq)
            deferred.append(chunk)
        return True

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
            self.seats.running_removed(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            assert self.swap is not None  # a sequence is swapped out only where there is swap space
            self.swapped.remove(seq)
            self.seats.pending_removed(seq)
            self.swap.free(seq.host_block_table)
            seq.host_block_table = []
        else:
            self.waiting.remove(seq)
            self.seats.pending_removed(seq)
        self.kv_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, num_tokens, samples=start + num_tokens == seq.num_tokens and seq.generates)

    def _preempt(self, seq: Sequence, may_swap: bool = True) -> list[tuple[int, int]]:
        """Take `seq`'s blocks away: swap its KV out if allowed and there is room, else free them to recompute."""
        seq.num_preemptions += 1
        self.num_preemptions += 1
        pairs = self.kv_manager.swap_out(seq, self.swap) if self.swap is not None and may_swap else None
        if pairs is not None:
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_sort_key)
            self.seats.pending_added(seq)
            return pairs
        self.kv_manager.free(seq)
        self.add(seq)
        return []


def _sort_key(seq: Sequence) -> tuple[int, int, float, int]:
    return seq.sort_key


def _admission_key(seq: Sequence) -> tuple[int, bool, int, float, int]:
    """Pending order: priority first; among equals a swapped sequence (it was running) comes first,
    then the fair-share rank and arrival."""
    return (seq.priority, seq.status is not SequenceStatus.SWAPPED, seq.share_rank, seq.times.arrival, seq.seq_id)
