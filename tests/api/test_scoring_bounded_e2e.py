"""Scoring bounded, through the API with a real worker, Postgres and Redis: the prompt-logprobs limit on every
way in (completions, chat, /v1/jobs, batch lines), vLLM's `prompt_logprobs` without echo, list pages that never
read prompt logprobs, and the tokenizer endpoints off the event loop."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import sqlalchemy
from sqlalchemy import event

from tests.api.conftest import ADMIN_KEY, ThreadedServer, free_port, stack_config, wait_for
from tokenloom.api.app import create_app
from tokenloom.api.served_model import ServedModel

LIMIT = 60  # the capped API's [server] max_prompt_logprob_entries
IDS = [1, 17, 42, 99, 5, 250, 31, 8, 8, 8]  # a 10-token prompt: 10 x (k + 1) x n entries
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def capped(stack):
    """A second API on the stack's database and worker whose limit is LIMIT entries."""
    config = stack_config(stack.checkpoint, stack.db_url).replace("server", max_prompt_logprob_entries=LIMIT)
    port = free_port()
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with (
        ThreadedServer(create_app(config, admin_key=ADMIN_KEY), port),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as client,
    ):
        yield client


def refused(reply: httpx.Response) -> dict:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert f"over this server's limit of {LIMIT} ([server] max_prompt_logprob_entries)" in error["message"]
    return error


@pytest.mark.parametrize(
    "fields, says, param",
    [
        ({"prompt_logprobs": 5}, "10 prompt tokens x (prompt_logprobs 5 + 1) x n 1 = 60", None),  # at the limit
        ({"prompt_logprobs": 6}, "10 prompt tokens x (prompt_logprobs 6 + 1) x n 1 = 70 entries", "prompt_logprobs"),
        ({"prompt_logprobs": 1, "n": 4}, "x (prompt_logprobs 1 + 1) x n 4 = 80 entries", "prompt_logprobs"),
        ({"echo": True, "logprobs": 6, "max_tokens": 0}, "x (logprobs 6 + 1) x n 1 = 70 entries", "logprobs"),
        (
            {"prompt": [IDS, IDS, IDS], "prompt_logprobs": 2},  # 30 entries each, 90 in one response
            "30 prompt tokens (over 3 prompts) x (prompt_logprobs 2 + 1) x n 1 = 90 entries",
            "prompt_logprobs",
        ),
    ],
)
def test_completions_over_the_limit_get_a_400_naming_it_and_the_numbers(stack, capped, fields, says, param):
    reply = capped.post("/v1/completions", json={"model": stack.model, "prompt": IDS, "max_tokens": 1, **fields})
    if param is None:
        assert reply.status_code == 200, reply.text
        return
    error = refused(reply)
    assert says in error["message"] and error["param"] == param


def test_chat_jobs_and_batch_lines_are_held_to_the_same_limit(stack, capped):
    chat = capped.post(
        "/v1/chat/completions",
        json={"model": stack.model, "messages": [{"role": "user", "content": "x" * 80}], "prompt_logprobs": 0},
    )
    assert "prompt tokens x (prompt_logprobs 0 + 1) x n 1" in refused(chat)["message"]
    jobs = capped.post("/v1/jobs", json=[{"prompt": IDS, "prompt_logprobs": 1}, {"prompt": IDS, "prompt_logprobs": 9}])
    assert refused(jobs)["message"].startswith("item 1: prompt logprobs too large: 10 prompt tokens")

    lines = [
        {
            "custom_id": "fits",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 2},
        },
        {
            "custom_id": "over",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 7},
        },
    ]
    uploaded = capped.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("scoring.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode())},
    ).json()
    batch = capped.post(
        "/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    ).json()

    def ended() -> dict | None:
        current = capped.get(f"/v1/batches/{batch['id']}").json()
        return current if current["status"] in ("completed", "failed") else None

    batch = wait_for(ended, "the batch to end")
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    (output,) = map(json.loads, capped.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines())
    (error,) = map(json.loads, capped.get(f"/v1/files/{batch['error_file_id']}/content").text.splitlines())
    assert output["custom_id"] == "fits"
    prompt_logprobs = output["response"]["body"]["choices"][0]["prompt_logprobs"]  # vLLM's, without echo
    assert prompt_logprobs[0] is None and all(str(t) in pos for t, pos in zip(IDS[1:], prompt_logprobs[1:]))
    assert error["custom_id"] == "over"
    assert (
        "10 prompt tokens x (prompt_logprobs 7 + 1) x n 1 = 80 entries" in error["response"]["body"]["error"]["message"]
    )


def test_prompt_logprobs_without_echo_come_back_as_vllm_returns_them(stack):
    with stack.client() as client:
        plain = client.post(
            "/v1/completions",
            json={"model": stack.model, "prompt": IDS, "max_tokens": 2, "n": 2, "temperature": 0, "prompt_logprobs": 2},
        ).json()
        echoed = client.post(
            "/v1/completions",
            json={"model": stack.model, "prompt": IDS, "max_tokens": 0, "echo": True, "logprobs": 2},
        ).json()
        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": stack.model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "prompt_logprobs": 0,
            },
        ).json()
    first, second = plain["choices"]
    assert first["prompt_logprobs"] == second["prompt_logprobs"]  # on each choice, as vLLM puts them
    assert first["logprobs"] is None  # the choices' own logprobs were not asked for
    scored = first["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(IDS)
    echo = echoed["choices"][0]["logprobs"]
    assert "prompt_logprobs" not in echoed["choices"][0]  # echo unchanged: the prompt is in its logprobs
    for position, token_id in enumerate(IDS[1:], 1):
        alternatives = scored[position]
        assert alternatives[str(token_id)]["logprob"] == pytest.approx(echo["token_logprobs"][position], abs=1e-6)
        ranked = sorted((a for a in alternatives.values() if a["rank"] is not None), key=lambda a: a["rank"])
        assert [a["rank"] for a in ranked][:2] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]
        assert max(echo["top_logprobs"][position].values()) == pytest.approx(ranked[0]["logprob"], abs=1e-6)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


class Statements:
    """Every SQL statement this process sends (the API under test runs in it), while listening."""

    def __init__(self):
        self.seen: list[str] = []

    def __enter__(self):
        event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc):
        event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", self._record)

    def _record(self, conn, cursor, statement, parameters, context, executemany):
        self.seen.append(statement)


def test_a_list_page_of_scoring_jobs_never_reads_their_prompt_logprobs(stack):
    with stack.client(stack.project_keys["lab-b"]) as client:
        created = client.post(
            "/v1/jobs", json=[{"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 3} for _ in range(25)]
        )
        assert created.status_code == 202, created.text
        ids = set(created.json()["ids"])

        def all_ended() -> bool:
            page = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
            return sum(job["id"] in ids and job["status"] in TERMINAL for job in page) == len(ids)

        wait_for(all_ended, "the scoring jobs to end")
        with Statements() as listed:
            reply = client.get("/v1/jobs", params={"limit": 100})
        with Statements() as read_one:
            one = client.get(f"/v1/jobs/{next(iter(ids))}").json()
    assert reply.status_code == 200
    mine = [job for job in reply.json()["data"] if job["id"] in ids]
    assert len(mine) == 25 and all(j["status"] == "succeeded" and j["prompt_logprobs"] is None for j in mine)
    page_queries = [s for s in listed.seen if "FROM jobs" in s]
    assert page_queries, listed.seen  # the listener saw the page being read
    for statement in page_queries:
        assert "prompt_logprobs" not in statement and "prompt_token_ids" not in statement, statement
    assert any("jobs.prompt_logprobs" in s for s in read_one.seen)  # one job is read whole
    assert len(one["prompt_logprobs"]) == len(IDS) and one["prompt_logprobs"][0]["top"] is None


class GatedCalls:
    """Wraps a tokenizer call: says when a request reached it, then holds it until released (a stand-in for a
    30 MB prompt that takes seconds, without depending on how fast this machine tokenizes)."""

    def __init__(self, call):
        self.call = call
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(120)
        return self.call(*args, **kwargs)


class GatedTokenizer(GatedCalls):
    def __getattr__(self, name):
        return getattr(self.call, name)


@pytest.mark.parametrize("endpoint", ["/tokenize", "/detokenize"])
def test_the_tokenizer_endpoints_leave_the_event_loop_free(stack, endpoint):
    config = stack_config(stack.checkpoint, stack.db_url)
    served = ServedModel.load(config.model, config.sampling)
    real_tokenizer = served.encoder.tokenizer
    real_decode = served.encoder.decode
    big = "Once upon a time " * 5_000  # the stack's body limit is 1 MiB: its token ids must fit too
    ids = real_tokenizer(big).input_ids
    if endpoint == "/tokenize":
        gate = served.encoder.tokenizer = GatedTokenizer(real_tokenizer)
        body: dict = {"prompt": big}
    else:
        gate = served.encoder.decode = GatedCalls(real_decode)  # type: ignore[method-assign]
        body = {"tokens": ids}
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    outcome: dict = {}

    def call() -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        outcome["reply"] = httpx.post(base_url + endpoint, json=body, headers=headers, timeout=180)

    with ThreadedServer(create_app(config, admin_key=ADMIN_KEY, served=served), port):
        caller = threading.Thread(target=call)
        caller.start()
        try:
            assert gate.entered.wait(60), "the request never reached the tokenizer"
            health = httpx.get(f"{base_url}/health", timeout=30)  # while the tokenizer holds that request
            assert health.status_code == 200 and health.json() == {"status": "ok"}
        finally:
            gate.release.set()
            caller.join(180)
    reply = outcome["reply"]
    assert reply.status_code == 200, reply.text
    if endpoint == "/tokenize":
        assert reply.json()["tokens"] == ids and reply.json()["count"] == len(ids)
    else:
        assert reply.json()["prompt"] == real_decode(ids, skip_special_tokens=False)
