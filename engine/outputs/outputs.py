"""What the engine hands back per request: text deltas while running, the full result at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.engine.config import MetricsConfig
from tokenloom.engine.core.sequence import Sequence
from tokenloom.engine.sample.sampler import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # everything generated so far (stop string excluded)
    token_ids: list[int]
    new_text: str  # the part of `text` that is new since the previous output of this request
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Seconds, derived from perf_counter timestamps as ARCHITECTURE.md defines them."""

    queue_s: float | None  # admitted - arrival
    ttft_s: float | None  # first token - arrival
    tpot_s: float | None  # (last token - first token) / (output tokens - 1); None for 1 token
    e2e_s: float | None  # finished - arrival
    itl_s: list[float] = field(default_factory=list)  # gaps between successive tokens
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], recording: MetricsConfig) -> "RequestMetrics":
        """The request's figures; TTFT and TPOT (with the ITLs) only where [metrics] records them."""
        arrival = seqs[0].times.arrival
        admitted = _min(s.times.admitted for s in seqs)
        first = _min(s.times.first_token for s in seqs)
        finished = max((s.times.finished for s in seqs if s.times.finished is not None), default=None)
        tpots = [t for t in (_tpot(s) for s in seqs) if t is not None]
        itl: list[float] = []
        for s in seqs:
            times = s.times.token_times
            itl.extend(b - a for a, b in zip(times, times[1:]))
        return cls(
            queue_s=None if admitted is None else admitted - arrival,
            ttft_s=None if first is None or not recording.enable_ttft else first - arrival,
            tpot_s=sum(tpots) / len(tpots) if tpots else None,
            e2e_s=None if finished is None else finished - arrival,
            itl_s=itl,
            num_cached_prompt_tokens=seqs[0].num_cached_prompt_tokens,
            num_preemptions=sum(s.num_preemptions for s in seqs),
        )


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # set once finished
    error: str | None = None  # set when the engine failed the request (finished, finish_reason "error")
    # prompt_logprobs asked: one entry per prompt token, None for the first; set once finished
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class EngineRequestError(RuntimeError):
    """The engine failed this request inside a step (the other requests carry on)."""


def _min(values):
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _tpot(seq: Sequence) -> float | None:
    times = seq.times.token_times
    if len(times) < 2:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)
