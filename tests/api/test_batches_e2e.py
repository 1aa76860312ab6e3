"""Files and Batches through the official `openai` SDK against uvicorn + Postgres + Redis + a real
worker: upload, create, poll to completed, output/error files in OpenAI's line formats (greedy text
equal to the in-process engine), validation errors naming the line, cancel, tenant isolation."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.api.conftest import MAX_BATCH_LINES, MAX_BODY_MB, MAX_FILE_MB, MAX_MODEL_LEN, STALL_MARKER
from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams

CHAT_URL = "/v1/chat/completions"
QUESTIONS = ["Tell me about batches", "What is a KV cache?", "Say something"]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def sdk_for(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def admin(stack) -> openai.OpenAI:
    return sdk_for(stack, stack.admin_key)


@pytest.fixture(scope="module")
def lab_a(stack) -> openai.OpenAI:
    return sdk_for(stack, stack.project_keys["lab-a"])


@pytest.fixture(scope="module")
def lab_b(stack) -> openai.OpenAI:
    return sdk_for(stack, stack.project_keys["lab-b"])


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT_URL,
        "body": {"messages": [{"role": "user", "content": content}], **GREEDY, **body},
    }


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def upload(client: openai.OpenAI, lines: list, name: str = "batch.jsonl"):
    return client.files.create(file=(name, jsonl(lines)), purpose="batch")


def wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout_s}s"
        time.sleep(0.2)
    return batch


def read_lines(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def reference(stack) -> dict[str, str]:
    """Greedy text of the in-process engine for each question (8 tokens, eos ignored)."""
    engine = Engine(engine_config(stack.checkpoint, model=dict(max_model_len=MAX_MODEL_LEN)))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [engine.encode_prompt(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
    return {q: out.outputs[0].text for q, out in zip(QUESTIONS, engine.generate(prompts, params))}


def test_a_batch_runs_to_completed_with_openai_output_and_error_files(lab_a, stack, reference):
    lines = [chat_line(f"q{i}", q, model=stack.model) for i, q in enumerate(QUESTIONS)]
    lines.insert(1, chat_line("too-long", "word " * 400))  # fails: longer than max_model_len
    uploaded = upload(lab_a, lines, "questions.jsonl")
    assert (uploaded.object, uploaded.purpose, uploaded.filename) == ("file", "batch", "questions.jsonl")
    assert uploaded.bytes == len(jsonl(lines)) and lab_a.files.retrieve(uploaded.id).id == uploaded.id
    assert lab_a.files.content(uploaded.id).content == jsonl(lines)

    batch = lab_a.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT_URL, completion_window="24h", metadata={"run": "e2e"}
    )
    assert batch.status in ("in_progress", "finalizing", "completed") and batch.metadata == {"run": "e2e"}
    assert batch.request_counts.total == 4 and batch.expires_at - batch.created_at == 24 * 3600
    done = wait_status(lab_a, batch.id, ("completed", "failed", "cancelled"))
    errors = read_lines(lab_a, done.error_file_id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1), errors
    assert done.completed_at >= done.finalizing_at >= done.in_progress_at >= done.created_at
    assert done.usage.output_tokens == 3 * 8 and done.usage.input_tokens > 0

    output = read_lines(lab_a, done.output_file_id)
    assert [line["custom_id"] for line in output] == ["q0", "q1", "q2"]
    for line, question in zip(output, QUESTIONS):
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == stack.model
        assert body["choices"][0]["message"] == {"role": "assistant", "content": reference[question]}
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8
    assert [line["custom_id"] for line in errors] == ["too-long"]
    assert errors[0]["response"]["status_code"] == 400
    assert "max_model_len" in errors[0]["response"]["body"]["error"]["message"]
    purposes = {f.id: f.purpose for f in lab_a.files.list()}
    assert purposes[done.output_file_id] == "batch_output" and purposes[done.error_file_id] == "batch_error"


@pytest.mark.parametrize(
    "bad_line, fragment",
    [
        (chat_line("a", "again"), "duplicate custom_id 'a' (first used on line 1)"),
        (chat_line("b", "streamed", stream=True), "stream must be false"),
        ({"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}}, "url must be one of"),
        ({"custom_id": "d", "url": CHAT_URL, "body": {}}, "missing method"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_a_malformed_batch_file_is_refused_at_upload_naming_the_line(lab_a, bad_line, fragment):
    with pytest.raises(openai.BadRequestError) as err:
        upload(lab_a, [chat_line("a", "first"), bad_line])
    assert err.value.body["message"].startswith("line 2 of the batch file:")
    assert fragment in err.value.body["message"]


def test_upload_limits_purpose_and_endpoint_mismatch(lab_a, stack):
    with pytest.raises(openai.BadRequestError) as err:
        upload(lab_a, [chat_line(f"n{i}", "x") for i in range(MAX_BATCH_LINES + 1)])
    assert "max_batch_lines" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        lab_a.files.create(file=("x.jsonl", jsonl([chat_line("a", "x")])), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    # Bigger than max_body_mb is fine for an upload, up to max_file_mb.
    big = [chat_line(f"big{i}", "y" * (MAX_BODY_MB * 2**20 // 4)) for i in range(5)]
    assert upload(lab_a, big).bytes > MAX_BODY_MB * 2**20
    assert MAX_BODY_MB * 2**20 < len(jsonl(big)) < MAX_FILE_MB * 2**20 < len(jsonl(big + big))
    with pytest.raises(openai.APIStatusError) as err:
        upload(lab_a, big + big)
    assert err.value.status_code == 413 and "max_file_mb" in err.value.body["message"]
    chat_file = upload(lab_a, [chat_line("a", "x")])
    with pytest.raises(openai.BadRequestError) as err:
        lab_a.batches.create(input_file_id=chat_file.id, endpoint="/v1/completions", completion_window="24h")
    assert "line 1" in err.value.body["message"] and err.value.body["param"] == "endpoint"
    wrong_model = upload(lab_a, [chat_line("a", "x", model="gpt-17")])
    with pytest.raises(openai.BadRequestError) as err:
        lab_a.batches.create(input_file_id=wrong_model.id, endpoint=CHAT_URL, completion_window="24h")
    assert "gpt-17" in err.value.body["message"] and stack.model in err.value.body["message"]
    for window in ("25h", "1d", "0s", "soon"):  # longer than OpenAI's 24h, or not a window
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            lab_a.batches.create(input_file_id=chat_file.id, endpoint=CHAT_URL, completion_window=window)
        assert "completion_window" in str(refused.value.body)


def test_cancelling_a_batch_stops_its_requests_and_writes_its_files(lab_b):
    # Stalled by the stack's worker: no request can end before the cancel (each needs >= 10 s).
    lines = [chat_line(f"long{i}", f"{STALL_MARKER} story {i}", max_tokens=200) for i in range(24)]
    batch = lab_b.batches.create(input_file_id=upload(lab_b, lines).id, endpoint=CHAT_URL, completion_window="24h")
    cancelling = lab_b.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = wait_status(lab_b, batch.id, ("cancelled", "completed"))
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts.total == 24 and done.request_counts.completed < 24
    assert len(read_lines(lab_b, done.output_file_id)) == done.request_counts.completed
    with pytest.raises(openai.ConflictError) as err:
        lab_b.batches.cancel(batch.id)
    assert "already cancelled" in err.value.body["message"]


def test_a_batch_whose_window_ends_expires_with_its_done_lines_and_the_rest_batch_expired(lab_b):
    # Two short lines end at once; the stalled ones need >= 10 s each, far past a 4 s window.
    lines = [chat_line(f"quick{i}", f"quick {i}") for i in range(2)]
    lines += [chat_line(f"long{i}", f"{STALL_MARKER} story {i}", max_tokens=200) for i in range(6)]
    batch = lab_b.batches.create(input_file_id=upload(lab_b, lines).id, endpoint=CHAT_URL, completion_window="4s")
    assert batch.expires_at == batch.created_at + 4
    done = wait_status(lab_b, batch.id, ("expired", "completed", "cancelled", "failed"))
    assert done.status == "expired" and done.expired_at is not None and done.expired_at >= batch.expires_at
    output = read_lines(lab_b, done.output_file_id)
    errors = read_lines(lab_b, done.error_file_id)
    assert sorted(line["custom_id"] for line in output + errors) == sorted(line["custom_id"] for line in lines)
    assert {line["custom_id"] for line in output} == {"quick0", "quick1"}
    assert all(line["response"]["status_code"] == 200 for line in output)
    for line in errors:  # OpenAI's shape for what the window did not reach
        assert line["response"] is None and line["error"]["code"] == "batch_expired", line
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 2, 6)


def test_output_files_expire_as_output_expires_after_asks(lab_a):
    lines = [chat_line("soon", "expiring output")]
    batch = lab_a.batches.create(
        input_file_id=upload(lab_a, lines).id,
        endpoint=CHAT_URL,
        completion_window="24h",
        extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 7200}},
    )
    done = wait_status(lab_a, batch.id, ("completed",))
    output = lab_a.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 7200
    for seconds in (60, 31 * 24 * 3600):  # OpenAI's bounds: one hour to thirty days
        with pytest.raises(openai.UnprocessableEntityError):
            lab_a.batches.create(
                input_file_id=upload(lab_a, lines).id,
                endpoint=CHAT_URL,
                completion_window="24h",
                extra_body={"output_expires_after": {"anchor": "created_at", "seconds": seconds}},
            )


def test_files_and_batches_of_another_project_are_404s(lab_a, lab_b, admin, stack):
    mine = upload(lab_a, [chat_line("iso", "isolated")])
    batch = lab_a.batches.create(input_file_id=mine.id, endpoint=CHAT_URL, completion_window="24h")
    for call in (
        lambda: lab_b.files.retrieve(mine.id),
        lambda: lab_b.files.content(mine.id),
        lambda: lab_b.batches.retrieve(batch.id),
        lambda: lab_b.batches.cancel(batch.id),
        lambda: lab_b.batches.create(input_file_id=mine.id, endpoint=CHAT_URL, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in {b.id for b in lab_b.batches.list()}
    assert mine.id not in {f.id for f in lab_b.files.list()}
    assert admin.batches.retrieve(batch.id).id == batch.id  # the admin key sees every project
    wait_status(lab_a, batch.id, ("completed",))


def test_batches_list_pages_newest_first(lab_a, stack):
    ids = [
        lab_a.batches.create(
            input_file_id=upload(lab_a, [chat_line("p", f"page {i}")]).id, endpoint=CHAT_URL, completion_window="24h"
        ).id
        for i in range(3)
    ]
    with stack.client(stack.project_keys["lab-a"]) as client:
        first = client.get("/v1/batches", params={"limit": 2}).json()
        second = client.get("/v1/batches", params={"limit": 2, "after": first["last_id"]}).json()
        assert client.get("/v1/batches", params={"after": "nope"}).status_code == 404
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    assert first["first_id"] == ids[2] and first["last_id"] == ids[1] and second["data"][0]["id"] == ids[0]
    assert [b.id for b in lab_a.batches.list(limit=2)][:3] == ids[::-1]  # the SDK follows has_more/after
    for batch_id in ids:
        wait_status(lab_a, batch_id, ("completed",))
