"""Logprobs through the official `openai` SDK against uvicorn + Postgres + Redis + a real worker, in
every shape a client can ask for them (chat and completions, whole and streamed, batch output lines,
GET /v1/jobs/{id}), each equal to what the in-process engine computes for the same request; and
the SSE keep-alive comment sent while a streamed job waits in the queue."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from tests.api.conftest import ADMIN_KEY, MAX_MODEL_LEN, ThreadedServer, free_port, stack_config
from tests.conftest import ORACLE_CONFIG, engine_config
from tokenloom.api.app import create_app
from tokenloom.api.openai import stream_relay
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.outputs.logprob_tokens import speller_for
from tokenloom.engine.sample.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": "Tell me about the engine"}]
PROMPT = "Once upon a time the engine"
NUM_TOKENS = 8
NUM_TOP = 2
GREEDY = dict(max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.admin_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(stack) -> dict:
    """The in-process engine's greedy outputs for CHAT and PROMPT with NUM_TOP alternatives per token,
    as (token id, logprob, [(alternative id, logprob)], bytes, [alternative bytes]) per token."""
    engine = Engine(engine_config(stack.checkpoint, model=dict(max_model_len=MAX_MODEL_LEN)))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=NUM_TOP)
    chat, text = engine.generate([engine.encode_prompt(messages=CHAT), PROMPT], params)
    speller = speller_for(engine.loaded.encoder.backend)

    def tokens(output):
        return [
            (lp.token_id, lp.logprob, lp.top, speller.spell(lp.token_id)[1], [speller.spell(i)[1] for i, _ in lp.top])
            for lp in output.outputs[0].logprobs
        ]

    return {"chat": tokens(chat), "text": tokens(text), "text_output": text.outputs[0].text}


def assert_chat_content_matches(content, expected):
    assert [c.bytes for c in content] == [e[3] for e in expected]
    assert [c.token for c in content] == [bytes(e[3]).decode("utf-8", errors="replace") for e in expected]
    assert [c.logprob for c in content] == pytest.approx([e[1] for e in expected], abs=TOLERANCE)
    assert [[t.bytes for t in c.top_logprobs] for c in content] == [e[4] for e in expected]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        pytest.approx([lp for _, lp in e[2]], abs=TOLERANCE) for e in expected
    ]


def assert_completion_logprobs_match(logprobs, expected):
    assert logprobs.token_logprobs == pytest.approx([e[1] for e in expected], abs=TOLERANCE)
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == NUM_TOKENS
    for token, top, e in zip(logprobs.tokens, logprobs.top_logprobs, expected):
        # The alternatives plus the sampled token (greedy: the sampled one is the best alternative).
        assert len(top) == NUM_TOP and top[token] == pytest.approx(e[1], abs=TOLERANCE)
        assert sorted(top.values(), reverse=True) == pytest.approx([lp for _, lp in e[2]], abs=TOLERANCE)


def test_chat_logprobs_equal_the_engine_s_and_the_job_row_holds_them(sdk, stack, reference):
    raw = sdk.chat.completions.with_raw_response.create(
        model=stack.model, messages=CHAT, logprobs=True, top_logprobs=NUM_TOP, **GREEDY
    )
    reply = raw.parse()
    assert reply.choices[0].logprobs.refusal is None
    assert_chat_content_matches(reply.choices[0].logprobs.content, reference["chat"])

    with stack.client() as client:
        job = client.get(f"/v1/jobs/{raw.headers['x-job-id']}").json()
    stored = job["choices"][0]["logprobs"]
    assert [e["token_id"] for e in stored] == [e[0] for e in reference["chat"]]
    assert [[pair[0] for pair in e["top"]] for e in stored] == [[i for i, _ in e[2]] for e in reference["chat"]]
    assert [[t["bytes"] for t in e["top_tokens"]] for e in stored] == [e[4] for e in reference["chat"]]


def test_chat_without_top_logprobs_gives_the_chosen_tokens_only(sdk, stack, reference):
    reply = sdk.chat.completions.create(model=stack.model, messages=CHAT, logprobs=True, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert [c.bytes for c in content] == [e[3] for e in reference["chat"]]
    assert all(c.top_logprobs == [] for c in content)
    plain = sdk.chat.completions.create(model=stack.model, messages=CHAT, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_equal_the_engine_s(sdk, stack, reference):
    reply = sdk.completions.create(model=stack.model, prompt=PROMPT, logprobs=NUM_TOP, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert_completion_logprobs_match(logprobs, reference["text"])
    text = reference["text_output"]
    assert reply.choices[0].text == text
    # Each offset is where its token's text starts in the choice's text.
    for token, offset in zip(logprobs.tokens, logprobs.text_offset):
        if not token.startswith("bytes:"):
            assert text[offset : offset + len(token)] == token


def test_streamed_logprobs_equal_the_whole_response_s(sdk, stack, reference):
    chat_chunks = list(
        sdk.chat.completions.create(
            model=stack.model, messages=CHAT, logprobs=True, top_logprobs=NUM_TOP, stream=True, **GREEDY
        )
    )
    content = [
        c
        for chunk in chat_chunks
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert_chat_content_matches(content, reference["chat"])

    text_chunks = [
        chunk
        for chunk in sdk.completions.create(model=stack.model, prompt=PROMPT, logprobs=NUM_TOP, stream=True, **GREEDY)
        if chunk.choices[0].logprobs
    ]
    whole = sdk.completions.create(model=stack.model, prompt=PROMPT, logprobs=NUM_TOP, **GREEDY).choices[0].logprobs
    for field in ("tokens", "text_offset"):
        assert [v for chunk in text_chunks for v in getattr(chunk.choices[0].logprobs, field)] == getattr(whole, field)
    streamed = [v for chunk in text_chunks for v in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.token_logprobs, abs=TOLERANCE)


def test_batch_output_lines_carry_logprobs(stack, reference):
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.project_keys["lab-a"], max_retries=0)
    line = {
        "custom_id": "lp",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": stack.model,
            "messages": CHAT,
            "max_tokens": NUM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": NUM_TOP,
        },
    }
    uploaded = client.files.create(file=("lp.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    assert batch.status == "completed"
    (output,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    body = openai.types.chat.ChatCompletion.model_validate(output["response"]["body"])
    assert_chat_content_matches(body.choices[0].logprobs.content, reference["chat"])


@pytest.fixture
def queue_only_server(stack, tmp_path, monkeypatch):
    """A second API on the stack's database whose model no worker serves: its jobs stay queued."""
    monkeypatch.setattr(stream_relay, "KEEP_ALIVE_S", 0.2)
    checkpoint = build_random_checkpoint(tmp_path / f"unserved-{uuid.uuid4().hex[:8]}", **ORACLE_CONFIG)
    port = free_port()
    with ThreadedServer(create_app(stack_config(checkpoint, stack.db_url), admin_key=ADMIN_KEY), port):
        yield f"http://127.0.0.1:{port}", str(checkpoint)


def test_a_stream_waiting_in_the_queue_gets_keep_alive_comments_until_it_ends(queue_only_server):
    base_url, model = queue_only_server
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        body = {"model": model, "messages": CHAT, "max_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            assert first == ": keep-alive"  # no worker serves this model: nothing else can come first
            job_id = stream.headers["x-job-id"]
            assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
            assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
            rest = [line for line in lines if line and line != ": keep-alive"]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
