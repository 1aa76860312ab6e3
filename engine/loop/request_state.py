"""What the engine keeps per request between steps: its sequences, their detokenizers and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.engine.core.sequence import Sequence
from tokenloom.engine.outputs.detokenizer import IncrementalDetokenizer
from tokenloom.engine.outputs.outputs import CompletionOutput
from tokenloom.engine.sample.sampler import TokenLogprobs


@dataclass(slots=True)
class RequestState:
    request_id: str
    seqs: list[Sequence]  # n of them, one per completion, sharing the prompt
    detokenizers: list[IncrementalDetokenizer]  # one per sequence
    logprobs: list[list[TokenLogprobs] | None]  # per sequence; None where logprobs were not asked
    num_reported_tokens: list[int] = field(default_factory=list)  # per sequence: tokens already in an output
    # prompt_logprobs: one entry per prompt token, None for the first (and until its position is scored)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # why the engine failed it, once it did

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def take_completions(self) -> list[CompletionOutput]:
        """Each sequence's output so far, with what is new since the last call (which it marks reported)."""
        completions = []
        for seq, detokenizer, logprobs in zip(self.seqs, self.detokenizers, self.logprobs):
            output_ids = seq.output_token_ids
            reported = self.num_reported_tokens[seq.index]
            self.num_reported_tokens[seq.index] = len(output_ids)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=detokenizer.text,
                    token_ids=output_ids,
                    new_text=detokenizer.take_delta(seq.is_finished),
                    new_token_ids=output_ids[reported:],
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                    logprobs=logprobs,
                )
            )
        return completions
