"""One generated sequence: its tokens, how much of it the KV cache holds, and its timestamps.

Plain Python (no torch): the scheduler and block manager operate on these and are unit-tested
without a model. A request with `n > 1` owns `n` sequences that share the prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenloom.engine.sample.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to host memory; resumes without recompute
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed while computing it (RequestOutput.error says why)


@dataclass(slots=True)
class SequenceTimes:
    """perf_counter() readings; ARCHITECTURE.md defines TTFT/TPOT/ITL from them."""

    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions this is
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    times: SequenceTimes
    priority: int = 0  # lower value = scheduled first and preempted last (vLLM's convention)
    # Order among equal priorities, ahead of arrival: a caller's fair-share position (the worker
    # gives a tenant's batch line the number of that tenant's lines it already holds, so tenants
    # interleave). Unlike priority it never preempts anything.
    share_rank: int = 0
    # Which guaranteed share of seats it draws from (engine/core/seat_share.py): the caller's class
    # of work, so a steady stream of better-priority requests never takes every seat.
    seat_class: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # swap-space blocks while SWAPPED
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at the last admission
    num_preemptions: int = 0
    # Prompt positions below this have had their next token's logprob computed (prompt_logprobs;
    # a position's logits score the prompt token after it). Kept across a preemption, so a
    # recompute neither loses nor repeats any.
    prompt_scored_until: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most tokens it may generate (its length if it runs to max_tokens)."""
        return self.num_prompt_tokens + (self.params.max_tokens or 0)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether this sequence computes its request's prompt logprobs (the first of n sequences does)."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def generates(self) -> bool:
        """False for a score-only request (max_tokens 0): its prefill's last logits are not sampled."""
        return self.params.max_tokens != 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, float, int]:
        """Scheduling order: priority first, then the fair-share rank, then first come first served."""
        return (self.priority, self.share_rank, self.times.arrival, self.seq_id)
