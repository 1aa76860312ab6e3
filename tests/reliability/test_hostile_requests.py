"""Bad and hostile request bodies against the real API process: each gets a clear 4xx in OpenAI's
error shape (never a 5xx), and nothing it queued is left stuck.

Prompts crafted as SQL or shell are stored byte for byte and nothing in them runs.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
from sqlalchemy import func, select, text

from tests.reliability.api_stack import MAX_BODY_MB
from tests.reliability.conftest import MAX_MODEL_LEN
from tokenloom.store.models import TERMINAL_JOB_STATUSES, ApiKey, Job

CHAT, COMPLETIONS, JOBS = "/v1/chat/completions", "/v1/completions", "/v1/jobs"
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OK_PROMPT = {"prompt": "hi", "max_tokens": 4}
LONG_PROMPT = "word " * (MAX_MODEL_LEN + 100)  # more tokens than max_model_len

# (id, path, body as JSON-able dict or raw bytes, expected status or None for "any 4xx")
CASES = [
    ("malformed-json", JOBS, b'{"prompt": "x", ', 422),
    ("json-not-object", COMPLETIONS, b"[1, 2", 422),
    ("empty-body", CHAT, b"", 422),
    ("prompt-wrong-type", COMPLETIONS, {"prompt": 5, "max_tokens": 4}, 422),
    ("max-tokens-string", JOBS, {"prompt": "x", "max_tokens": "10"}, 422),
    ("temperature-string", CHAT, {**OK_CHAT, "temperature": "hot"}, 422),
    ("messages-not-list", CHAT, {"messages": "hi"}, 422),
    ("missing-messages", CHAT, {"max_tokens": 4}, 422),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 4}, 422),
    ("job-without-prompt-or-messages", JOBS, {"max_tokens": 4}, None),
    ("huge-max-tokens", COMPLETIONS, {**OK_PROMPT, "max_tokens": 10**30}, None),
    ("huge-seed", COMPLETIONS, {**OK_PROMPT, "seed": 2**80}, 422),
    ("huge-priority", JOBS, {**OK_PROMPT, "priority": 10**12}, 422),
    ("huge-n", COMPLETIONS, {**OK_PROMPT, "n": 10**9}, 422),
    ("huge-float", COMPLETIONS, b'{"prompt": "x", "max_tokens": 4, "temperature": 1e400}', None),
    ("negative-temperature", COMPLETIONS, {**OK_PROMPT, "temperature": -1.0}, None),
    ("negative-top-p", CHAT, {**OK_CHAT, "top_p": -0.5}, None),
    ("nan-temperature", COMPLETIONS, b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}', None),
    ("infinity-top-p", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', None),
    ("negative-max-tokens", JOBS, {"prompt": "x", "max_tokens": -3}, None),
    ("unknown-model", CHAT, {**OK_CHAT, "model": "no-such-model"}, 404),
    # An unknown field is accepted with a warning header (tests/api/test_openai_fields_e2e.py);
    # one that would change the output and is not supported is a 400 naming it.
    ("unsupported-field", COMPLETIONS, {**OK_PROMPT, "suffix": "tail"}, 400),
    ("unsupported-tool-call", CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    (
        "uncompilable-schema",
        CHAT,
        {
            **OK_CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
        },
        400,
    ),
    ("logit-bias-out-of-range", COMPLETIONS, {**OK_PROMPT, "logit_bias": {"1": 500}}, 422),
    ("max-tokens-beyond-max-model-len", COMPLETIONS, {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, 400),
    ("prompt-over-max-model-len", JOBS, {"prompt": LONG_PROMPT, "max_tokens": 4}, 400),
    ("chat-prompt-over-max-model-len", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400),
    ("empty-messages", CHAT, {"messages": [], "max_tokens": 4}, None),
    ("empty-prompt", COMPLETIONS, {"prompt": "", "max_tokens": 4}, None),
    ("invalid-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}, None),
    ("message-without-content", CHAT, {"messages": [{"role": "user"}], "max_tokens": 4}, None),
    ("token-id-out-of-vocab", COMPLETIONS, {"prompt": [10**9], "max_tokens": 4}, None),
    ("negative-token-id", COMPLETIONS, {"prompt": [-1], "max_tokens": 4}, None),
    ("non-utf8-bytes", COMPLETIONS, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}', None),
    ("non-utf8-in-chat", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', None),
    ("lone-surrogate", COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 4}', None),
    ("empty-job-list", JOBS, [], None),
    ("deeply-nested", JOBS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("stream-option-of-the-wrong-type", CHAT, {**OK_CHAT, "stream_options": {"include_usage": "yes"}}, 422),
]


def _send(client, path: str, body):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize("path,body,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_a_clear_4xx(api_stack, path, body, expected):
    with api_stack.client() as client:
        response = _send(client, path, body)
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if expected is not None:
        assert response.status_code == expected, response.text[:500]
    error = response.json()["error"]
    assert error["message"] and error["type"], error


def test_a_100_mb_body_is_refused_with_413(api_stack):
    body = b'{"prompt": "' + b"x" * (100 * 2**20) + b'"}'
    with api_stack.client() as client:
        declared = client.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
        assert declared.status_code == 413 and f"{MAX_BODY_MB:g} MiB" in declared.json()["error"]["message"]

        def chunks():  # no Content-Length: the server must count and stop, not buffer 100 MB
            for start in range(0, len(body), 2**20):
                yield body[start : start + 2**20]

        try:
            streamed = client.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
        except Exception as exc:  # noqa: BLE001 - the server may close before reading everything
            pytest.fail(f"a chunked 100 MB body should get a 413, got {type(exc).__name__}: {exc}")
        assert streamed.status_code == 413, streamed.text[:300]


def test_sql_and_shell_in_prompts_are_stored_verbatim_and_never_run(api_stack, tmp_path):
    marker = tmp_path / f"pwned-{uuid.uuid4().hex[:8]}"
    hostile = [
        "'); DROP TABLE jobs; --",
        "Robert'); DELETE FROM api_keys WHERE ('1'='1",
        f"$(touch {marker}) `touch {marker}` ; touch {marker} && echo pwned | sh",
        "%s %n %x {0} {{prompt}} ${HOME} \\x00 \\\\ \\' \"",
        "\u202eevil\u202c 🧨 \U0001f4a5 ׂ\u0301\u0301\u0301 \ufeff",
    ]
    items = [{"prompt": p, "custom_id": p[:512], "max_tokens": 4, "temperature": 0.0} for p in hostile]
    with api_stack.client() as client:
        created = client.post(JOBS, json=items)
        assert created.status_code == 202, created.text
        ids = created.json()["ids"]
        deadline = time.monotonic() + 60
        while (jobs := [client.get(f"{JOBS}/{i}").json() for i in ids]) and any(
            j["status"] not in ("succeeded", "failed") for j in jobs
        ):
            assert time.monotonic() < deadline, jobs
            time.sleep(0.2)
    assert [j["status"] for j in jobs] == ["succeeded"] * len(hostile), jobs
    assert [j["custom_id"] for j in jobs] == [p[:512] for p in hostile]  # returned verbatim
    with api_stack.sessions() as session:
        stored = {str(j.id): j.prompt for j in session.execute(select(Job).where(Job.id.in_(ids))).scalars()}
        assert [stored[i] for i in ids] == hostile  # stored byte for byte
        assert session.execute(select(func.count()).select_from(ApiKey)).scalar_one() >= 2  # nothing deleted
        assert session.execute(text("SELECT to_regclass('jobs') IS NOT NULL")).scalar_one()
    assert not marker.exists() and not os.path.exists(f"{marker}")  # no shell ran


def test_a_nul_character_in_a_prompt_is_refused_or_stored_never_a_5xx(api_stack):
    """Postgres text columns cannot hold U+0000: the API must refuse it with a 4xx (or store it)."""
    bodies = [
        (JOBS, {"prompt": "before\u0000after", "max_tokens": 4}),
        (CHAT, {"messages": [{"role": "user", "content": "a\u0000b"}], "max_tokens": 4}),
        (JOBS, {"prompt": "x", "custom_id": "id\u0000", "max_tokens": 4}),
    ]
    answers = []
    for path, body in bodies:
        with api_stack.client() as client:  # a fresh connection each: a 500 closes the connection
            response = client.post(path, json=body)
        answers.append((path, response.status_code, response.text[:200]))
    assert all(status < 500 for _, status, _ in answers), answers


def test_no_job_is_left_stuck(api_stack):
    """Whatever the requests above queued ends (they are tiny); none stays queued or running."""
    deadline = time.monotonic() + 60
    while True:
        with api_stack.sessions() as session:
            open_jobs = session.execute(
                select(func.count())
                .select_from(Job)
                .where(Job.status.not_in(TERMINAL_JOB_STATUSES), Job.project == "default")
            ).scalar_one()
        if not open_jobs:
            return
        assert time.monotonic() < deadline, f"{open_jobs} jobs still open after 60 s"
        time.sleep(0.5)


def test_the_error_bodies_are_json_objects(api_stack):
    with api_stack.client() as client:
        response = _send(client, COMPLETIONS, b"\x00\x01\x02")
    assert response.status_code == 422 and isinstance(json.loads(response.text)["error"], dict)
