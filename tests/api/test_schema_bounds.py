"""The API's request schema takes its numeric bounds from the engine's one table
(engine/sample/bounds.py), so a value the API accepts is one the engine accepts and the reverse."""

from __future__ import annotations

import pytest

from tokenloom.api.openai.openai_schemas import ChatCompletionRequest, CompletionRequest
from tokenloom.engine.sample.bounds import LOGIT_BIAS_BOUND, SAMPLING_BOUNDS

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it

# API field -> engine field; the API caps max_tokens and min_tokens at its request-size limit.
SHARED = {
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "seed": "seed",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logprobs": "logprobs",
}
API_CAPPED = {"max_tokens": "max_tokens", "min_tokens": "min_tokens"}


def _schema_limits(model, name: str) -> dict:
    properties = model.model_json_schema()["properties"][name]
    schema = next(option for option in properties.get("anyOf", [properties]) if option.get("type") != "null")
    return {
        key.replace("exclusiveMinimum", "gt").replace("minimum", "ge").replace("maximum", "le"): value
        for key, value in schema.items()
        if key in ("minimum", "exclusiveMinimum", "maximum")
    }


@pytest.mark.parametrize("api_name, engine_name", SHARED.items())
def test_each_shared_bound_is_the_engines(api_name, engine_name):
    model = CompletionRequest if api_name != "top_logprobs" else ChatCompletionRequest
    assert _schema_limits(model, api_name) == SAMPLING_BOUNDS[engine_name].schema_limits()


@pytest.mark.parametrize("api_name, engine_name", API_CAPPED.items())
def test_the_api_only_narrows_a_bound(api_name, engine_name):
    limits, engine = _schema_limits(CompletionRequest, api_name), SAMPLING_BOUNDS[engine_name].schema_limits()
    assert limits["ge"] == engine["ge"] and "le" not in engine and limits["le"] > 0


def test_chat_top_logprobs_and_logit_bias_use_the_engines_bounds():
    assert _schema_limits(ChatCompletionRequest, "top_logprobs") == SAMPLING_BOUNDS["logprobs"].schema_limits()
    bias = ChatCompletionRequest.model_json_schema()["properties"]["logit_bias"]
    values = next(o for o in bias["anyOf"] if o.get("type") == "object")["additionalProperties"]
    assert {"ge": values["minimum"], "le": values["maximum"]} == LOGIT_BIAS_BOUND.schema_limits()
