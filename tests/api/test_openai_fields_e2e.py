"""What real OpenAI clients send, through the official `openai` SDK against uvicorn + Postgres + Redis +
a real worker: harmless fields accepted, unsupported ones refused by name, unknown ones ignored with a
warning (refused under strict_fields), logit_bias, and structured output on chat, completions, jobs
and batch lines (validated with `jsonschema`)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.api.conftest import ThreadedServer, free_port, stack_config
from tests.api.test_batches_e2e import read_lines, upload, wait_status
from tokenloom.api.app import create_app

CHAT = [{"role": "user", "content": "Describe a person"}]
PROMPT = "A person:"
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]}},
        "required": ["mood"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}},
        "required": ["age", "ok"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.admin_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def strict_sdk(stack):
    """A second API on the same database and worker, with [server] strict_fields = true."""
    config = stack_config(stack.checkpoint, stack.db_url).replace("server", strict_fields=True)
    port = free_port()
    with ThreadedServer(create_app(config, admin_key=stack.admin_key), port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=stack.admin_key, max_retries=0, timeout=120)


def json_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def assert_valid(text: str, finish_reason: str, schema: dict) -> None:
    assert finish_reason in ("stop", "length")
    if finish_reason == "stop":  # "length": cut by max_tokens, the one case allowed not to parse
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "fields",
    [
        {"metadata": {"team": "x"}},
        {"store": False},
        {"service_tier": "auto"},
        {"user": "u-1"},
        {"parallel_tool_calls": False},
        {"response_format": {"type": "text"}},
        {"tool_choice": "none"},
        {"seed": 3, "metadata": {"a": "b"}, "store": True, "service_tier": "default", "user": "u"},
    ],
    ids=lambda f: ",".join(f),
)
def test_harmless_openai_fields_give_200(sdk, stack, fields):
    reply = sdk.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=2, **fields)
    assert reply.choices[0].message.content is not None
    # The SDK's completions.create names fewer of these: send them as the raw JSON a client would.
    text = sdk.completions.create(model=stack.model, prompt=PROMPT, max_tokens=2, extra_body=fields)
    assert text.choices[0].text is not None


def test_stream_options_is_accepted(sdk, stack):
    chunks = list(
        sdk.chat.completions.create(
            model=stack.model, messages=CHAT, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None


@pytest.mark.parametrize(
    "call,fields,name",
    [
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
            "tools",
        ),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("text", {"suffix": "end"}, "suffix"),
        ("text", {"best_of": 3}, "best_of"),
    ],
)
def test_output_changing_unsupported_fields_get_400_naming_them(sdk, stack, call, fields, name):
    create = sdk.chat.completions.create if call == "chat" else sdk.completions.create
    target = {"messages": CHAT} if call == "chat" else {"prompt": PROMPT}
    with pytest.raises(openai.BadRequestError) as info:
        create(model=stack.model, max_tokens=2, **target, **fields)
    error = info.value.body
    assert error["param"] == name and f"{name}" in error["message"] and "not supported" in error["message"]


def test_unknown_fields_are_ignored_with_a_warning_header(sdk, stack):
    raw = sdk.chat.completions.with_raw_response.create(
        model=stack.model, messages=CHAT, max_tokens=2, extra_body={"frobnicate": 1, "temprature": 0}
    )
    assert raw.headers["x-tokenloom-ignored-fields"] == "frobnicate, temprature"
    assert raw.parse().choices[0].finish_reason in ("stop", "length")


def test_an_unknown_field_name_no_header_can_carry_is_escaped(stack):
    """Any JSON key can be a field name: non-Latin-1 text and CR/LF come back escaped, never a 500
    or a split header."""
    with stack.client() as client:
        reply = client.post(
            "/v1/completions",
            json={
                "model": stack.model,
                "prompt": "0",
                "max_tokens": 1,
                "\u0100\U00079449": None,
                "a\r\nX-Injected: 1": 2,
            },
        )
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-tokenloom-ignored-fields"] == "\\u0100\\ud9a5\\udc49, a\\r\\nX-Injected: 1"
    assert "x-injected" not in reply.headers


def test_strict_fields_refuses_unknown_fields_by_name(strict_sdk, stack):
    with pytest.raises(openai.BadRequestError) as info:
        strict_sdk.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=2, extra_body={"temprature": 0})
    assert "'temprature' (did you mean 'temperature'?)" in info.value.body["message"]
    assert info.value.body["param"] == "temprature"
    # Harmless OpenAI fields still pass under strict.
    strict_sdk.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=2, metadata={"a": "b"})


def _job_token_ids(stack, job_id: str) -> list[int]:
    with stack.client() as client:
        return client.get(f"/v1/jobs/{job_id}").json()["output_token_ids"]


def test_logit_bias_forces_and_bans_tokens(sdk, stack):
    raw = sdk.completions.with_raw_response.create(
        model=stack.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    assert _job_token_ids(stack, raw.headers["x-job-id"]) == [42] * 4
    plain = sdk.completions.with_raw_response.create(
        model=stack.model, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    first = _job_token_ids(stack, plain.headers["x-job-id"])[0]
    banned = sdk.completions.with_raw_response.create(
        model=stack.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={str(first): -100},
        extra_body={"ignore_eos": True},
    )
    assert _job_token_ids(stack, banned.headers["x-job-id"])[0] != first
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        sdk.completions.create(model=stack.model, prompt=PROMPT, max_tokens=2, logit_bias={"99999999": 5})


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
def test_json_schema_outputs_validate_batched_with_unconstrained_requests(sdk, stack, sampling):
    def constrained(name):
        reply = sdk.chat.completions.create(
            model=stack.model, messages=CHAT, max_tokens=MAX_TOKENS, response_format=json_format(name), **sampling
        )
        return name, reply.choices[0].message.content, reply.choices[0].finish_reason

    def free(_):
        return sdk.completions.create(model=stack.model, prompt=PROMPT, max_tokens=24, **sampling)

    with ThreadPoolExecutor(8) as pool:  # in flight together, so the worker batches them into the same steps
        results = list(pool.map(constrained, list(SCHEMAS) * 2))
        frees = list(pool.map(free, range(4)))
    for name, text, finish_reason in results:
        assert_valid(text, finish_reason, SCHEMAS[name])
    assert sum(r[2] == "stop" for r in results) >= len(results) // 2, results
    assert all(f.choices[0].finish_reason in ("stop", "length") for f in frees)


def test_completions_and_structured_outputs_extras(sdk, stack):
    reply = sdk.completions.create(
        model=stack.model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": json_format("enum")},
    )
    assert_valid(reply.choices[0].text, reply.choices[0].finish_reason, SCHEMAS["enum"])
    choices = ["red", "green", "blue"]
    for seed in range(3):
        reply = sdk.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert reply.choices[0].message.content in choices and reply.choices[0].finish_reason == "stop"
    pattern = r"[a-z]{3}-\d{2}"
    reply = sdk.completions.create(
        model=stack.model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0.7,
        seed=2,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, reply.choices[0].text) and reply.choices[0].finish_reason == "stop"


def test_a_schema_the_engine_cannot_compile_gets_400_naming_the_construct(sdk, stack):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}}
    with pytest.raises(openai.BadRequestError, match="cannot be used for structured output.*missing"):
        sdk.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=4, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="Lookbehind is not supported"):
        sdk.completions.create(
            model=stack.model, prompt=PROMPT, max_tokens=4, extra_body={"structured_outputs": {"regex": "(?<=a)b"}}
        )


def test_jobs_and_batch_lines_take_structured_output(sdk, stack):
    with stack.client() as client:
        created = client.post(
            "/v1/jobs",
            json={
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "response_format": json_format("numbers"),
            },
        ).json()
        job_id = created["ids"][0]
    lines = [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": stack.model,
                "messages": CHAT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "response_format": json_format(name),
            },
        }
        for name in SCHEMAS
    ]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_status(sdk, batch.id, ("completed",), timeout_s=300)
    outputs = read_lines(sdk, batch.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(SCHEMAS)
    for line in outputs:
        choice = line["response"]["body"]["choices"][0]
        assert_valid(choice["message"]["content"], choice["finish_reason"], SCHEMAS[line["custom_id"]])
    with stack.client() as client:
        job = _wait_job(client, job_id)
    assert_valid(job["output_text"], job["finish_reason"], SCHEMAS["numbers"])


def _wait_job(client, job_id: str, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']}"
        time.sleep(0.1)
    assert job["status"] == "succeeded", job
    return job
