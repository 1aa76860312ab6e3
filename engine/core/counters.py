"""Engine-wide counters: what the scheduler did, step by step (exported as metrics later)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.engine.core.scheduler import SchedulerOutput


@dataclass(slots=True)
class EngineCounters:
    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens computed
    num_decode_tokens: int = 0  # single-token steps of sequences past their prompt
    num_scheduled_seqs: int = 0  # summed over steps; / num_steps = mean batch size
    max_batch_seqs: int = 0
    num_mixed_steps: int = 0  # steps that packed prefill chunks and decodes together
    max_prefill_chunks_in_step: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0  # preemptions that kept the KV in host memory instead of recomputing
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which served from cache

    def record_step(self, plan: SchedulerOutput) -> None:
        self.num_steps += 1
        num_prefill_chunks = 0
        for chunk in plan.chunks:
            if chunk.num_tokens == 1 and chunk.start >= chunk.seq.num_prompt_tokens:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += chunk.num_tokens
                num_prefill_chunks += 1
        num_seqs = len(plan.chunks)
        self.num_scheduled_seqs += num_seqs
        self.max_batch_seqs = max(self.max_batch_seqs, num_seqs)
        self.max_prefill_chunks_in_step = max(self.max_prefill_chunks_in_step, num_prefill_chunks)
        if num_prefill_chunks and num_prefill_chunks < num_seqs:
            self.num_mixed_steps += 1

    @property
    def mean_batch_seqs(self) -> float:
        return self.num_scheduled_seqs / self.num_steps if self.num_steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
