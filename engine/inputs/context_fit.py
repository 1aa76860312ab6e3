"""Does a request fit in max_model_len? One rule for the engine and for the API (which checks
before queueing, so a job that cannot run is refused with a 400 instead of failing later)."""

from __future__ import annotations

from dataclasses import replace

from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams


def fit_to_context(
    params: SamplingParams, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int
) -> SamplingParams:
    """`params` with max_tokens set (no max_tokens: the default, capped to the room left), or
    InvalidRequestError saying what to change when the prompt or max_tokens does not fit."""
    room = max_model_len - num_prompt_tokens
    if room < (0 if params.max_tokens == 0 else 1):  # a score-only request (max_tokens 0) may fill it
        raise InvalidRequestError(
            f"prompt has {num_prompt_tokens:,} tokens but max_model_len is {max_model_len:,}: "
            "shorten the prompt or raise [model] max_model_len"
        )
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
        params = replace(params, max_tokens=max_tokens)
    elif max_tokens > room:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens:,} tokens) + max_tokens ({max_tokens:,}) exceeds "
            f"max_model_len ({max_model_len:,}): lower max_tokens to at most {room:,}"
        )
    if params.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens:,}) does not fit: only {max_tokens:,} tokens can be "
            f"generated after this prompt within max_model_len ({max_model_len:,})"
        )
    return params
