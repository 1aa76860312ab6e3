"""Request bodies of POST /v1/chat/completions and /v1/completions (OpenAI's names, vLLM's extras).

Types and bounds here make the OpenAPI document precise and give 422s that name the field; the
numeric bounds come from the engine's one table (engine/sample/bounds.py); the engine's own validation (SamplingParams, openai_protocol/batch_input.py) still runs afterwards, so the
API, the worker and `tokenloom run` refuse exactly the same requests. Fields not declared here are
let through to that validation, which applies one rule (openai_protocol/request_fields.py): OpenAI's
harmless fields are ignored, unsupported output-changing ones get a 400 naming them, unknown ones
are ignored with a warning (refused under [server] strict_fields).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tokenloom.engine import LOGIT_BIAS_BOUND, SAMPLING_BOUNDS
from tokenloom.store.jobs.work_class import PRIORITY_LIMIT, ServiceTier

MAX_TOKENS_LIMIT = 1_048_576
MAX_PROMPT_TOKEN_IDS = 1_048_576
MAX_MESSAGES = 4096


def _limits(name: str) -> dict[str, float]:
    """The engine's bound of a sampling field (engine/sample/bounds.py) as pydantic keywords."""
    return SAMPLING_BOUNDS[name].schema_limits()


PositiveTokens = Annotated[StrictInt, Field(**{**_limits("max_tokens"), "le": MAX_TOKENS_LIMIT})]
Penalty = Annotated[StrictFloat, Field(**_limits("presence_penalty"))]
TokenId = Annotated[StrictInt, Field(ge=0)]
StopList = Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=16)]


MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each is a job)
TextPrompt = Annotated[StrictStr, Field(min_length=1)]
TokenIdPrompt = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
# OpenAI's four shapes: a string, token ids, or a list of either (one choice set per prompt). An
# empty list passes the schema so that the route can answer 400 saying so.
Prompt = (
    TextPrompt
    | TokenIdPrompt
    | Annotated[list[TextPrompt], Field(max_length=MAX_PROMPTS)]
    | Annotated[list[TokenIdPrompt], Field(max_length=MAX_PROMPTS)]
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. continuous_usage_stats: accepted, ignored
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints; None = unset, so the worker's [sampling] default applies."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = Field(None, description="the served model (GET /v1/models)")
    max_tokens: PositiveTokens | None = None
    temperature: Annotated[StrictFloat, Field(**_limits("temperature"))] | None = None
    top_p: Annotated[StrictFloat, Field(**_limits("top_p"))] | None = None
    n: Annotated[StrictInt, Field(**_limits("n"))] | None = None
    stop: Annotated[StrictStr, Field(min_length=1)] | StopList | None = None
    seed: Annotated[StrictInt, Field(**_limits("seed"))] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None  # accepted, ignored
    logit_bias: dict[str, Annotated[float, Field(**LOGIT_BIAS_BOUND.schema_limits())]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit; -100 bans it, 100 forces it"
    )
    response_format: dict | None = Field(
        None,
        description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
        '{"name": ..., "schema": {...}}}: the output is constrained to it',
    )
    # OpenAI's tiers, mapped onto tokenloom's classes of work (store/jobs/work_class.py, docs/priority.md).
    service_tier: ServiceTier | None = None
    # OpenAI fields that change nothing here: accepted and ignored.
    metadata: dict | None = None
    store: StrictBool | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's extensions
    top_k: Annotated[StrictInt, Field(ge=-1, le=1_000_000)] | None = (
        None  # vLLM's -1 (= 0, off) too; capped for the schema
    )
    min_p: Annotated[StrictFloat, Field(**_limits("min_p"))] | None = None
    min_tokens: Annotated[StrictInt, Field(**{**_limits("min_tokens"), "le": MAX_TOKENS_LIMIT})] | None = None
    ignore_eos: StrictBool | None = None
    repetition_penalty: Annotated[StrictFloat, Field(**_limits("repetition_penalty"))] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    skip_special_tokens: StrictBool | None = None
    structured_outputs: dict | None = Field(
        None,
        description='one of {"json": schema}, {"regex": "..."}, {"choice": [...]}, {"grammar": "EBNF"}, '
        '{"json_object": true} (vLLM\'s)',
    )


class StreamingFields(SamplingFields):
    # vLLM's: orders the request within its class of work; lower runs first.
    priority: Annotated[StrictInt, Field(ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)] = 0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: passed to the chat template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class ChatCompletionRequest(StreamingFields):
    messages: Messages
    max_completion_tokens: PositiveTokens | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(**_limits("logprobs"))] | None = None


class CompletionRequest(StreamingFields):
    prompt: Prompt
    logprobs: Annotated[StrictInt, Field(**_limits("logprobs"))] | None = None
    echo: StrictBool | None = Field(
        None,
        description="each choice starts with the prompt; with `logprobs` the prompt's tokens get logprobs "
        "too (the first null); with `max_tokens: 0` the prompt is scored, nothing generated",
    )
    prompt_logprobs: Annotated[StrictInt, Field(**_limits("prompt_logprobs"))] | None = Field(
        None, description="vLLM's: the logprob of each prompt token after the first, with this many alternatives"
    )

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts in order: one for a string or a token-id list, each item of a list of them."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)
