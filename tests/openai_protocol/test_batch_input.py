"""openai_protocol/batch_input.py: each accepted line shape, and each kind of bad line."""

import json

import pytest

from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams
from tokenloom.openai_protocol.batch_input import BatchItem, BatchLineError, parse_line

DEFAULTS = SamplingParams(temperature=0.7, top_p=0.9)
CHAT = [{"role": "user", "content": "Hi"}]


def parse(obj, number=3, defaults=DEFAULTS, strict=False):
    line = obj if isinstance(obj, str) else json.dumps(obj)
    return parse_line(line, number, defaults, strict=strict)


def ok(obj, **kw) -> BatchItem:
    item = parse(obj, **kw)
    assert isinstance(item, BatchItem), item
    return item


def err(obj, **kw) -> BatchLineError:
    item = parse(obj, **kw)
    assert isinstance(item, BatchLineError), item
    return item


def openai(url, body, **extra):
    return {"custom_id": "req-1", "method": "POST", "url": url, "body": body, **extra}


# --- simple shape ------------------------------------------------------------------------


def test_simple_prompt_takes_defaults_and_line_custom_id():
    item = ok({"prompt": "Hello"}, number=7)
    assert item.line_number == 7 and item.custom_id == "line-7"
    assert item.prompt == "Hello" and item.messages is None
    assert item.params.temperature == 0.7 and item.params.top_p == 0.9
    assert item.params.max_tokens is None  # up to the context, capped by [sampling] max_tokens


def test_simple_keeps_custom_id_and_token_id_prompt():
    item = ok({"custom_id": "abc", "prompt": [1, 5, 9], "max_tokens": 4})
    assert item.custom_id == "abc" and item.prompt == [1, 5, 9] and item.params.max_tokens == 4


def test_simple_messages():
    item = ok({"messages": CHAT, "temperature": 0})
    assert item.messages == CHAT and item.prompt is None and item.params.temperature == 0


def test_openai_and_vllm_sampling_fields():
    item = ok(
        {
            "prompt": "x",
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 0.8,
            "stop": "END",
            "seed": 3,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logprobs": 2,
            "n": 3,
            "top_k": -1,
            "min_p": 0.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "repetition_penalty": 1.2,
            "stop_token_ids": [7, 8],
            "skip_special_tokens": False,
        }
    )
    p = item.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (8, 0.5, 0.8, ["END"], 3)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.n) == (0.5, -0.5, 2, 3)
    assert (p.top_k, p.min_p, p.min_tokens, p.ignore_eos) == (0, 0.1, 2, True)
    assert (p.repetition_penalty, p.stop_token_ids, p.skip_special_tokens) == (1.2, [7, 8], False)


def test_null_sampling_value_means_default():
    assert ok({"prompt": "x", "temperature": None}).params.temperature == 0.7


def test_model_user_and_stream_false_are_ignored():
    item = ok({"prompt": "x", "model": "gpt-4o", "user": "u1", "stream": False})
    assert item.prompt == "x"


def test_max_completion_tokens_alias():
    assert ok({"prompt": "x", "max_completion_tokens": 12}).params.max_tokens == 12
    assert ok({"prompt": "x", "max_completion_tokens": 12, "max_tokens": 12}).params.max_tokens == 12
    e = err({"prompt": "x", "max_completion_tokens": 12, "max_tokens": 5})
    assert "max_completion_tokens" in e.message and "max_tokens" in e.message


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": True}, 0),
        ({"logprobs": False}, None),
        ({"logprobs": 3}, 3),
        ({"logprobs": 0}, 0),
        ({}, None),
    ],
)
def test_logprobs_chat_and_completions_styles(fields, expected):
    assert ok({"prompt": "x", **fields}).params.logprobs == expected


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"top_logprobs": 3}, 'logprobs": true'),
        ({"logprobs": False, "top_logprobs": 3}, 'logprobs": true'),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
        ({"logprobs": 25}, "logprobs must be <= 20"),
    ],
)
def test_bad_logprobs(fields, needle):
    assert needle in err({"prompt": "x", **fields}).message


# --- OpenAI Batch API shape --------------------------------------------------------------


def test_openai_chat_line():
    item = ok(
        openai(
            "/v1/chat/completions",
            {
                "model": "gpt-4o-mini",
                "messages": CHAT,
                "max_completion_tokens": 9,
                "logprobs": True,
                "top_logprobs": 2,
                "user": "me",
            },
        )
    )
    assert item.custom_id == "req-1" and item.messages == CHAT and item.prompt is None
    assert item.params.max_tokens == 9 and item.params.logprobs == 2
    assert item.params.temperature == 0.7  # defaults still apply


@pytest.mark.parametrize("prompt", ["Once upon", [1, 2, 3]])
def test_openai_completions_line(prompt):
    item = ok(openai("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4, "logprobs": 1}))
    assert item.prompt == prompt and item.messages is None and item.params.logprobs == 1


@pytest.mark.parametrize(
    "body, prompt_logprobs",
    [
        ({"echo": True, "logprobs": 2, "max_tokens": 0}, 2),  # OpenAI's scoring request: the prompt's logprobs too
        ({"echo": True, "max_tokens": 0}, None),  # the prompt's text only
        ({"prompt_logprobs": 5, "logprobs": 1}, 5),  # vLLM's: prompt alternatives of their own
        ({"echo": False, "logprobs": 2}, None),
    ],
)
def test_echo_and_prompt_logprobs(body, prompt_logprobs):
    item = parse_line(json.dumps(openai("/v1/completions", {"prompt": [1, 5, 9], **body})), 1)
    assert item.echo is body.get("echo", False) and item.params.prompt_logprobs == prompt_logprobs
    assert item.params.max_tokens == body.get("max_tokens")


@pytest.mark.parametrize(
    "line, needle",
    [
        ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}, "custom_id"),
        (openai("/v1/embeddings", {"input": "x"}), "url must be"),
        (openai("/v1/completions", {"prompt": "x"}, method="GET"), 'method must be "POST"'),
        (openai("/v1/completions", "prompt"), "body must be a JSON object"),
        (openai("/v1/chat/completions", {"prompt": "x"}), "'prompt' is not accepted"),
        (openai("/v1/completions", {"messages": CHAT}), "'messages' is not accepted"),
        (openai("/v1/chat/completions", {"messages": CHAT, "stream": True}), "stream"),
        (openai("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}), "tools is not supported"),
        (openai("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}), "tool_choice 'required'"),
        (openai("/v1/chat/completions", {"messages": CHAT, "echo": True}), "echo applies to /v1/completions"),
        (openai("/v1/completions", {"prompt": "x", "echo": "yes"}), "echo must be true or false"),
        (openai("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}), "prompt_logprobs must be <= 20"),
        (openai("/v1/completions", {"prompt": "x", "best_of": 3}), "best_of"),
        (openai("/v1/chat/completions", {"model": "m"}), "missing 'messages'"),
        (openai("/v1/completions", {"prompt": "x"}, extra=1), "'extra'"),
        ({**openai("/v1/completions", {"prompt": "x"}), "custom_id": 5}, "custom_id must be"),
    ],
)
def test_openai_line_errors(line, needle):
    e = err(line)
    assert needle in e.message, e.message


def test_openai_error_keeps_custom_id():
    e = err(openai("/v1/completions", {"prompt": "x", "temperature": -1}))
    assert e.custom_id == "req-1" and e.line_number == 3


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "not valid JSON"),
        ("", "empty line"),
        ("[1, 2]", "must be a JSON object, got a list"),
        ('"text"', "must be a JSON object, got a string"),
        ({"custom_id": "a"}, "missing 'prompt' or 'messages'"),
        ({"prompt": "x", "messages": CHAT}, "not both"),
        ({"prompt": 5}, "prompt must be a string or a list of integer token ids"),
        ({"prompt": ["a", "b"]}, "non-integer"),
        ({"prompt": [1, True]}, "non-integer"),
        ({"messages": "hi"}, "messages must be a non-empty list"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"prompt": "x", "custom_id": ""}, "custom_id must be a non-empty string"),
        ({"prompt": "x", "custom_id": 12}, "custom_id must be a non-empty string"),
        ({"prompt": "x", "stream": True}, "stream"),
        ({"prompt": "x", "stop": 5}, "stop must be"),
        ({"prompt": "x", "stop": {"a": 1}}, "stop must be"),
        ({"prompt": "x", "stop": [1]}, "stop must be"),
        ({"prompt": "x", "stop_token_ids": 7}, "stop_token_ids must be"),
        ({"prompt": "x", "stop_token_ids": ["7"]}, "stop_token_ids must be"),
        ({"prompt": "x", "n": 0}, "n must be >= 1"),
        ({"prompt": "x", "seed": 1.5}, "seed must be an integer"),
        ({"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens must be >= 0"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_lines(line, needle):
    e = err(line)
    assert needle in e.message, e.message


def test_invalid_params_carry_the_sampling_params_message():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"temperature": -1}, DEFAULTS)
    e = err({"custom_id": "neg", "prompt": "x", "temperature": -1})
    assert e.message == str(info.value) and e.custom_id == "neg"


def test_unknown_fields_are_ignored_and_listed_unless_strict():
    line = {"custom_id": "u", "prompt": "x", "frobnicate": 1, "temprature": 0}
    item = ok(line)
    assert item.unknown_fields == ("frobnicate", "temprature") and item.params.temperature != 0
    e = err(line, strict=True)
    assert "'frobnicate'" in e.message and "'temprature' (did you mean 'temperature'?)" in e.message
    assert "strict_fields" in e.message and e.custom_id == "u" and e.param == "frobnicate"


@pytest.mark.parametrize(
    "field,value",
    [
        ("metadata", {"k": "v"}),
        ("store", True),
        ("service_tier", "auto"),
        ("user", "u1"),
        ("parallel_tool_calls", True),
        ("stream_options", {"include_usage": True}),
        ("tools", []),
        ("tool_choice", "none"),
        ("response_format", {"type": "text"}),
        ("echo", False),
    ],
)
def test_harmless_openai_fields_are_accepted_and_ignored(field, value):
    item = ok(openai("/v1/chat/completions", {"messages": CHAT, field: value}), strict=True)
    assert item.unknown_fields == () and item.params.structured_outputs is None


def test_structured_output_and_logit_bias_fields_set_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    item = ok(
        openai(
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "logit_bias": {"5": -100},
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            },
        )
    )
    assert item.params.structured_outputs == {"json": schema} and item.params.logit_bias == {5: -100.0}
    item = ok({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert item.params.structured_outputs == {"choice": ["a", "b"]}
    e = err({"prompt": "x", "structured_outputs": {"regex": "(a"}})
    assert "structured_outputs.regex cannot be used" in e.message


def test_custom_id_in_error_only_when_it_is_a_string():
    assert err("{bad").custom_id is None
    assert err({"custom_id": 3, "prompt": "x"}).custom_id is None


def test_utf8_bom_and_whitespace_are_tolerated():
    assert ok('\ufeff  {"prompt": "x"}\n').prompt == "x"


@pytest.mark.parametrize(
    "line",
    [
        "null",
        "1e400",
        '{"prompt": "x", "temperature": NaN}',
        '{"prompt": "x", "top_p": Infinity}',
        '{"prompt": null}',
        '{"body": null}',
        "[" * 100_000,
        '{"prompt": "x", "n": 1e999}',
        '{"prompt": "x", "stop": [""]}',
        '{"prompt": "x", "logprobs": "yes"}',
    ],
)
def test_never_raises(line):
    assert isinstance(parse(line), BatchLineError)


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt": "a\\ud800b"}',
        '{"messages": [{"role": "user", "content": "\\udc00"}]}',
    ],
)
def test_lone_surrogates_are_rejected(line):
    assert "unpaired surrogate" in err(line).message


def test_surrogate_pairs_are_fine():
    assert ok('{"prompt": "\\ud83d\\ude00"}').prompt == "\U0001f600"
