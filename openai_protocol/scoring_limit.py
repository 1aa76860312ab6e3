"""How many prompt logprobs one request may ask for: one rule for the API, the worker and `tokenloom run`.

A request that asks for prompt logprobs (vLLM's `prompt_logprobs: k`, or completions' `echo` with
`logprobs: k`) makes one stored entry per prompt token, each holding its token and k alternatives,
and its response repeats them in each of its `n` choices (OpenAI's echo shape puts the prompt's
tokens in every choice's logprobs; vLLM puts `prompt_logprobs` on every choice). So what it costs
is counted in entries, prompt tokens x (k + 1) x n, and every process that holds them (the
worker that computes them, the API that reads the row and writes the body, `tokenloom run`)
needs memory in proportion: measured as peak RSS growth, up to 1.6 KB per entry in the API
(k = 0 without echo; about 1.1 KB at k = 20, 0.2 KB per entry of n > 1 echoed choices) and
0.6 KB in the worker, beyond what the prompt's prefill needs anyway (docs/api.md#scoring). A
request over `[server] max_prompt_logprob_entries` is refused before anything runs, with a
message that names the limit and the request's numbers.
"""

from __future__ import annotations

from tokenloom.engine import InvalidRequestError, SamplingParams

LIMIT_KEY = "[server] max_prompt_logprob_entries"
# Its default: a request's prompt logprobs take at most about 0.8 GB in the API and 0.3 GB in the worker.
DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES = 500_000


class PromptLogprobsTooLargeError(InvalidRequestError):
    """The request asks for more prompt logprob entries than the limit; `param` names the field that
    asked for them (`prompt_logprobs`, or `logprobs` when echo did)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def prompt_logprob_entries(params: SamplingParams, num_prompt_tokens: int) -> int:
    """Entries the request's prompt logprobs make in its response: 0 when it asks for none."""
    if params.prompt_logprobs is None:
        return 0
    return num_prompt_tokens * (params.prompt_logprobs + 1) * params.n


def check_prompt_logprob_entries(
    params: SamplingParams, num_prompt_tokens: int, limit: int, *, echo: bool = False, num_prompts: int = 1
) -> None:
    """Raise PromptLogprobsTooLargeError when the request's entries exceed `limit`. `num_prompt_tokens`:
    the request's prompt tokens, summed over its `num_prompts` prompts (one response holds them all)."""
    entries = prompt_logprob_entries(params, num_prompt_tokens)
    if entries <= limit:
        return
    asked_by_echo = echo and params.logprobs is not None and params.prompt_logprobs == params.logprobs
    field = "logprobs" if asked_by_echo else "prompt_logprobs"
    tokens = f"{num_prompt_tokens:,} prompt tokens" + (f" (over {num_prompts:,} prompts)" if num_prompts > 1 else "")
    raise PromptLogprobsTooLargeError(
        f"prompt logprobs too large: {tokens} x ({field} {params.prompt_logprobs} + 1) x n {params.n} = "
        f"{entries:,} entries, over this server's limit of {limit:,} ({LIMIT_KEY}): ask for fewer "
        "alternatives, a smaller n, or split the prompt",
        field,
    )
