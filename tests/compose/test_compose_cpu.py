"""`docker compose --profile cpu up -d --wait` on a real Docker engine serves what the docs promise,
through the API port it publishes on 127.0.0.1: an OpenAI chat completion, a 20-line Batch API
job run to completion, /metrics, a healthy CPU worker; and a worker restarted mid-batch loses no
line and answers none twice; scaled to two CPU workers it answers every line once. The stack:
conftest.py; the model: the default demo (SmolLM2).
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import openai
import pytest

from tests.compose.compose_project import ComposeProject, wait_until
from tests.compose.phase_clock import PhaseClock

CHAT_URL = "/v1/chat/completions"
NUM_LINES = 20
BATCH_DEADLINE_S = 600  # a bound for a broken stack; 2 CPU cores run the batches in well under that
RESTART_TIMEOUT_S = 300  # the worker's stop_grace_period (40 s) + its start and model load


def base_url(stack: ComposeProject) -> str:
    return f"http://127.0.0.1:{stack.shell['API_HOST_PORT']}"


@pytest.fixture(scope="module")
def sdk(stack: ComposeProject) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_url(stack)}/v1", api_key=stack.shell["TOKENLOOM_API_KEY"], max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def model(sdk: openai.OpenAI) -> str:
    [served] = sdk.models.list().data
    return served.id


def chat_line(custom_id: str, content: str, model: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body}


def submit_batch(sdk: openai.OpenAI, lines: list[dict]) -> str:
    uploaded = sdk.files.create(
        file=("lines.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch"
    )
    return sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT_URL, completion_window="24h").id


def finished(sdk: openai.OpenAI, batch_id: str):
    batch = sdk.batches.retrieve(batch_id)
    return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None


def wait_finished(sdk: openai.OpenAI, stack: ComposeProject, batch_id: str, what: str):
    """The batch once it ends (the workers' logs printed if it does not within BATCH_DEADLINE_S)."""
    return wait_until(
        lambda: finished(sdk, batch_id), BATCH_DEADLINE_S, what, poll_s=1, log=lambda: stack.logs("worker-cpu")
    )


def answered_ids(sdk: openai.OpenAI, batch) -> Counter[str]:
    """How often each custom_id appears in the output file; every line must have succeeded."""
    output = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
    return Counter(line["custom_id"] for line in output)


def test_a_chat_completion_through_the_published_port(sdk: openai.OpenAI, model: str):
    reply = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is Docker?"}], max_tokens=12, temperature=0
    )
    assert reply.object == "chat.completion" and reply.model == model
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content.strip()
    assert 0 < reply.usage.completion_tokens <= 12


def test_a_20_line_batch_runs_to_completed(sdk: openai.OpenAI, model: str, stack: ComposeProject, phases: PhaseClock):
    lines = [chat_line(f"line-{i}", f"Count to {i + 1}.", model, max_tokens=8) for i in range(NUM_LINES)]
    with phases.phase("20-line batch"):
        batch_id = submit_batch(sdk, lines)
        batch = wait_finished(sdk, stack, batch_id, "the batch to finish")
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (20, 20, 0)
    assert answered_ids(sdk, batch) == Counter(line["custom_id"] for line in lines)
    assert batch.usage.output_tokens == NUM_LINES * 8


def test_metrics_are_served_on_the_published_port(stack: ComposeProject):
    metrics = httpx.get(f"{base_url(stack)}/metrics", timeout=30)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "tokenloom_" in metrics.text and 'status="succeeded"' in metrics.text


def test_the_services_are_healthy_by_their_own_healthchecks(stack: ComposeProject):
    assert stack.health("worker-cpu") == "healthy"  # `tokenloom health worker`: a fresh heartbeat
    assert stack.health("api") == stack.health("postgres") == stack.health("redis") == "healthy"
    migrate = stack.state("migrate")
    assert (migrate["Status"], migrate["ExitCode"]) == ("exited", 0)


def test_a_worker_restarted_mid_batch_loses_no_line_and_answers_none_twice(
    sdk: openai.OpenAI, model: str, stack: ComposeProject, phases: PhaseClock
):
    # Lengths from 8 to 198 tokens: lines finish one after another, so the restart lands while
    # some are answered and others are running or queued.
    lines = [chat_line(f"restart-{i}", "Tell me a story.", model, max_tokens=8 + 10 * i) for i in range(NUM_LINES)]
    started_before = stack.state("worker-cpu")["StartedAt"]
    with phases.phase("20-line batch with `docker compose restart worker-cpu`"):
        batch_id = submit_batch(sdk, lines)
        partly = wait_until(
            lambda: (b := sdk.batches.retrieve(batch_id)).request_counts.completed > 0 and b,
            BATCH_DEADLINE_S,
            "the first answered line",
            poll_s=0.2,
        )
        assert partly.request_counts.completed < NUM_LINES, "the batch finished before the restart: lengthen it"
        stack.compose("restart", "worker-cpu", timeout_s=RESTART_TIMEOUT_S)
        batch = wait_finished(sdk, stack, batch_id, "the batch to finish after the restart")
    assert stack.state("worker-cpu")["StartedAt"] != started_before  # it did restart
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (NUM_LINES, 0)
    assert answered_ids(sdk, batch) == Counter(line["custom_id"] for line in lines)  # each exactly once
    assert batch.usage.output_tokens == sum(line["body"]["max_tokens"] for line in lines)


def test_scaled_to_two_cpu_workers_the_stack_answers_every_line_once(
    sdk: openai.OpenAI, model: str, stack: ComposeProject, phases: PhaseClock
):
    # `--scale worker-cpu=2` on the running stack (issue 44): the new replica shares the models
    # volume (the demo model is built once: engine/models/build_once.py) and takes lines beside the first.
    with phases.phase("`up --scale worker-cpu=2` and a 20-line batch"):
        done = stack.compose(
            "--profile", "cpu", "up", "--detach", "--wait", "--scale", "worker-cpu=2", check=False, timeout_s=600
        )
        assert done.returncode == 0, f"scale failed:\n{done.stderr[-3000:]}\n{stack.logs('worker-cpu')}"
        replicas = stack.compose("ps", "--quiet", "worker-cpu").stdout.split()
        assert len(replicas) == 2, replicas
        lines = [chat_line(f"scaled-{i}", "Name a colour.", model, max_tokens=16) for i in range(NUM_LINES)]
        batch_id = submit_batch(sdk, lines)
        batch = wait_finished(sdk, stack, batch_id, "the batch on two workers")
    for replica in replicas:  # both healthy by their own healthcheck (a fresh heartbeat each)
        state = json.loads(stack.engine.docker("inspect", replica).stdout)[0]["State"]
        assert state["Health"]["Status"] == "healthy", state
    assert batch.status == "completed" and batch.request_counts.completed == NUM_LINES, batch
    assert answered_ids(sdk, batch) == Counter(line["custom_id"] for line in lines)  # each exactly once
