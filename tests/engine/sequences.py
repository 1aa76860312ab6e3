"""Sequence objects for the pure-Python scheduler and KV-manager tests (no model needed)."""

from tokenloom.engine.core.sequence import Sequence, SequenceTimes
from tokenloom.engine.sample.sampling_params import SamplingParams


def make_seq(seq_id, prompt, max_tokens=8, priority=0, arrival=None, share_rank=0, seat_class=0):
    """`prompt` is a token list or a length (then tokens unique to this sequence)."""
    tokens = list(prompt) if not isinstance(prompt, int) else [seq_id * 1000 + i for i in range(prompt)]
    return Sequence(
        seq_id=seq_id,
        request_id=f"req-{seq_id}",
        index=0,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        params=SamplingParams(max_tokens=max_tokens),
        times=SequenceTimes(arrival=float(seq_id if arrival is None else arrival)),
        priority=priority,
        share_rank=share_rank,
        seat_class=seat_class,
    )
