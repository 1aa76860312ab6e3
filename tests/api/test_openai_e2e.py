"""The OpenAI-compatible endpoints through the official `openai` SDK, a raw SSE reader and the
seed article's verification client, against uvicorn + Postgres + Redis + a real worker."""

from __future__ import annotations

import contextlib
import io
import json
import re

import httpx
import openai
import pytest

from tests.api.conftest import MAX_MODEL_LEN, STALL_MARKER
from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": "Tell me about the engine"}]
PROMPT = "Once upon a time the engine"


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.admin_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(stack):
    """Greedy token ids of the in-process engine for CHAT and PROMPT (16 tokens, eos ignored)."""
    engine = Engine(engine_config(stack.checkpoint, model=dict(max_model_len=MAX_MODEL_LEN)))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    chat_ids = engine.encode_prompt(messages=CHAT)
    chat, text = engine.generate([chat_ids, PROMPT], params)
    return {
        "chat": chat.outputs[0].text,
        "text": text.outputs[0].text,
        "chat_prompt_tokens": len(chat_ids),
        "text_ids": text.outputs[0].token_ids,
    }


GREEDY = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})


def test_chat_non_streaming_matches_the_in_process_engine(sdk, stack, reference):
    reply = sdk.chat.completions.create(model=stack.model, messages=CHAT, **GREEDY)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == reference["chat"]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 16
    assert reply.usage.prompt_tokens == reference["chat_prompt_tokens"]


def test_chat_streaming_sends_one_chunk_per_token_then_finish_and_usage(sdk, stack, reference):
    chunks = list(
        sdk.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(token_chunks) == 16
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in token_chunks) == reference["chat"]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert [c.choices[0].finish_reason for c in finish] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completions_streaming_and_not_agree_with_the_engine(sdk, stack, reference):
    reply = sdk.completions.create(model=stack.model, prompt=PROMPT, **GREEDY)
    assert reply.object == "text_completion" and reply.choices[0].text == reference["text"]
    streamed = list(sdk.completions.create(model=stack.model, prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == reference["text"]
    assert streamed[-1].choices[0].finish_reason == "length"


def test_models_lists_the_served_model(sdk, stack):
    assert [m.id for m in sdk.models.list().data] == [stack.model]
    assert sdk.models.retrieve(stack.model).id == stack.model


def test_unknown_model_is_a_404_naming_the_served_one(sdk, stack):
    with pytest.raises(openai.NotFoundError) as err:
        sdk.chat.completions.create(model="gpt-17", messages=CHAT)
    assert stack.model in err.value.body["message"] and err.value.body["param"] == "model"


def test_invalid_sampling_values_are_400s_or_422s_that_name_the_field(sdk, stack):
    with pytest.raises(openai.UnprocessableEntityError) as err:
        sdk.chat.completions.create(model=stack.model, messages=CHAT, temperature=-1)
    assert "temperature" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # caught by the engine's own validation
        sdk.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=4, extra_body={"min_tokens": 9})
    assert "min_tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=stack.model, prompt="word " * 400)
    assert "max_model_len" in err.value.body["message"]


def test_client_disconnect_does_not_cancel_the_job(stack):
    # Stalled by the stack's worker (>= 100 * STALL_STEP_S = 5 s, on any CPU): the hang-up comes mid-job.
    with stack.client() as client:
        body = {
            "model": stack.model,
            "prompt": f"{STALL_MARKER} {PROMPT}",
            "max_tokens": 100,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with client.stream("POST", "/v1/completions", json=body) as response:
            job_id = response.headers["x-job-id"]
            next(response.iter_lines())  # read one line, then hang up
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
        job = _wait_terminal(client, job_id)
    assert job["status"] == "succeeded" and job["completion_tokens"] == 100


def test_the_seed_articles_verification_client_works_unchanged_but_for_url_key_and_model(stack):
    """The article's script, verbatim except API_BASE / API_KEY and [model] name (its placeholder)."""
    script = (
        VERIFICATION_CLIENT.replace("https://taotoken.net/api", stack.base_url)
        .replace('os.environ["TAOTOKEN_API_KEY"]', repr(stack.admin_key))
        .replace("your-model-name", stack.model)
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "verification_client.py", "exec"), {})
    lines = out.getvalue().splitlines()
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-4] == "data: [DONE]"
    assert re.fullmatch(r"TTFT: \d+\.\d{3}s", lines[-3]) and re.fullmatch(r"TPOT: \d+\.\d{3}s", lines[-2])
    tokens = [c for c in data if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len(tokens) >= 1 and len(data) == len(tokens) + 1  # one line per token, then the finish line


def _wait_terminal(client: httpx.Client, job_id: str, timeout_s: float = 60) -> dict:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout_s}s")


# The seed article's client (../shared/seed/inference-article.zh.txt, section 5), line breaks restored.
VERIFICATION_CLIENT = """
import os
import time
import requests
API_BASE = "https://taotoken.net/api"
API_KEY = os.environ["TAOTOKEN_API_KEY"]
headers = {
    "Authorization": f"Bearer {API_KEY}",
    "Content-Type": "application/json"
}
payload = {
    "model": "your-model-name",
    "messages": [
        {"role": "user", "content": "用一句话解释 KV Cache 的作用"}
    ],
    "max_tokens": 128,
    "temperature": 0.7,
    "stream": True
}
start = time.time()
first_token_time = None
token_count = 0
with requests.post(
    f"{API_BASE}/v1/chat/completions",
    headers=headers,
    json=payload,
    stream=True
) as resp:
    for line in resp.iter_lines():
        if not line:
            continue
        if first_token_time is None:
            first_token_time = time.time()
        token_count += 1
        print(line.decode("utf-8"))
end = time.time()
ttft = first_token_time - start
tpot = (end - first_token_time) / max(token_count - 1, 1)
print(f"TTFT: {ttft:.3f}s")
print(f"TPOT: {tpot:.3f}s")
print(f"总耗时: {end - start:.3f}s")
"""
