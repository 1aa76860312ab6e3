"""Which positions of a prefill chunk score the prompt (prompt logprobs), and how far a sequence
may reuse the prefix cache while it still has positions to score.

The logits at position p give the log-probability of token p + 1, so a prompt of P tokens is
scored by positions 0 .. P - 2 (the first prompt token has no logprob; position P - 1 predicts the
first generated token and is sampled, not scored). Positions are scored once per request, by its
first sequence, in whichever chunks compute them.
"""

from __future__ import annotations

from tokenloom.engine.core.sequence import Sequence


def scored_positions(seq: Sequence, start: int, end: int) -> range:
    """The positions in [start, end) whose logits score a prompt token and are not scored yet."""
    if not seq.scores_prompt:
        return range(0)
    return range(max(start, seq.prompt_scored_until), max(start, min(end, seq.num_prompt_tokens - 1)))


def cacheable_prefix_tokens(seq: Sequence) -> int | None:
    """The most leading tokens `seq` may take from the prefix cache (None: no limit). A position
    read from the cache is not computed, so its logits are not there to score the prompt: a
    sequence still scoring may reuse only positions it has scored already."""
    if not seq.scores_prompt or seq.prompt_scored_until >= seq.num_prompt_tokens - 1:
        return None
    return seq.prompt_scored_until
