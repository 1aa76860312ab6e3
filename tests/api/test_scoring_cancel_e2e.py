"""A scoring job cancelled while its prompt is being prefilled ends `cancelled`, not failed: the API on the
stack's database, a real worker of its own whose engine prefills 32 tokens per step, each step stalled (the
stall marker, engine/testing/fault_injection.py), Postgres and Redis.

The prompt needs PROMPT_TOKENS / BATCHED_TOKENS = 250 steps, so its prefill cannot end by itself in under
250 x STALL_STEP_S = 12.5 s on any CPU. The test acts on states: it cancels once the worker has published
prefill progress for the job (its engine figures in Redis), and then checks from the row that the cancel
landed mid-prefill: the first positions were scored, the last were not. The same worker also refuses a row
that no API counted (`tokenloom submit`) when it asks for more prompt logprobs than the worker's limit."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import redis

from tests.api.conftest import ADMIN_KEY, ThreadedServer, free_port, stack_config, wait_for
from tests.conftest import ORACLE_CONFIG
from tests.services import running_worker
from tokenloom.api.app import create_app
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.testing.fault_injection import STALL_STEP_S
from tokenloom.settings.config import load_config
from tokenloom.store.celery_app import make_celery
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.engine_stats import ENGINE_STATS_PREFIX
from tokenloom.store.jobs.job_service import submit_file

STALL_MARKER = "~SCORE-STALL~"
MAX_MODEL_LEN = 8192
BATCHED_TOKENS = 32
PROMPT_TOKENS = 8000
WORKER_LIMIT = 30_000  # the worker's [server] max_prompt_logprob_entries: the cancelled job's 24,000 fit
assert PROMPT_TOKENS / BATCHED_TOKENS * STALL_STEP_S >= 12


@pytest.fixture(scope="module")
def slow_prefill(stack, tmp_path_factory):
    """(API client, model name, broker url): a worker and an API of their own for a long-context checkpoint."""
    root = tmp_path_factory.mktemp("scoring-cancel")
    checkpoint = build_random_checkpoint(
        root / f"long-llama-{uuid.uuid4().hex[:8]}",
        seed=0,
        **{**ORACLE_CONFIG, "max_position_embeddings": MAX_MODEL_LEN},
    )
    settings = {
        "TOKENLOOM_MODEL_NAME": str(checkpoint),
        "TOKENLOOM_MODEL_DTYPE": "float32",
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "TOKENLOOM_DATABASE_URL": stack.db_url,
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": "2",
        "TOKENLOOM_SCHEDULER_MAX_NUM_BATCHED_TOKENS": str(BATCHED_TOKENS),
        "TOKENLOOM_QUEUE_LEASE_S": "3",  # engine figures published every second
        "TOKENLOOM_FAULT_INJECT_PROMPT": f"stall:{STALL_MARKER}",
        "TOKENLOOM_SERVER_MAX_PROMPT_LOGPROB_ENTRIES": str(WORKER_LIMIT),
    }
    config = stack_config(checkpoint, stack.db_url).replace("model", max_model_len=MAX_MODEL_LEN)
    port = free_port()
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with (
        running_worker(settings, 2, root / "worker.log") as env,
        ThreadedServer(create_app(config, admin_key=ADMIN_KEY), port),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as client,
    ):
        yield client, str(checkpoint), load_config(None, env=env).queue.broker_url


def prefilled_tokens(broker: redis.Redis, model: str) -> int:
    """Prompt tokens the model's worker has computed, as its last heartbeat published them."""
    total = 0
    for key in broker.scan_iter(match=f"{ENGINE_STATS_PREFIX}*"):
        figures = broker.hgetall(key)
        if figures.get(b"model", b"").decode() == model:
            total += int(figures.get(b"prefill_tokens", 0))
    return total


def test_a_scoring_job_cancelled_mid_prefill_ends_cancelled_with_the_positions_it_scored(slow_prefill):
    client, model, broker_url = slow_prefill
    ids = client.post("/tokenize", json={"prompt": STALL_MARKER, "add_special_tokens": False}).json()["tokens"]
    prompt = [1, *ids, *([17, 42, 99, 5] * PROMPT_TOKENS)][:PROMPT_TOKENS]
    created = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2})
    assert created.status_code == 202, created.text
    job_id = created.json()["ids"][0]

    broker = redis.Redis.from_url(broker_url)
    try:
        wait_for(lambda: prefilled_tokens(broker, model) > 0, "the worker to prefill part of the prompt")
    finally:
        broker.close()
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled"), cancelled.text

    job = wait_for(
        lambda: (
            (row := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("succeeded", "failed", "cancelled") and row
        ),
        "the job to end",
    )
    assert job["status"] == "cancelled", job["error"]
    assert job["error"] is None and job["completion_tokens"] == 0
    entries = job["prompt_logprobs"]
    assert len(entries) == PROMPT_TOKENS and [e["token_id"] for e in entries] == prompt
    scored = [position for position, entry in enumerate(entries) if entry["logprob"] is not None]
    assert scored and scored == list(range(1, len(scored) + 1))  # a prefix was scored...
    assert len(scored) < PROMPT_TOKENS - 1 and entries[-1]["top"] is None  # ...and the rest never was
    assert all(len(entries[p]["top"]) == 2 for p in scored)


def test_the_worker_refuses_a_row_no_api_checked_that_asks_for_more_prompt_logprobs_than_its_limit(
    slow_prefill, stack, tmp_path
):
    """`tokenloom submit` queues rows without tokenizing them, so no API counted their prompt logprobs: the
    worker counts them before they run, and fails the job as invalid instead of taking its memory."""
    client, model, broker_url = slow_prefill
    text = "The cat sat on the mat, and then it slept. " * 100
    num_tokens = client.post("/tokenize", json={"prompt": text}).json()["count"]
    assert num_tokens * 21 > WORKER_LIMIT
    source = tmp_path / "scoring.jsonl"
    source.write_text(json.dumps({"custom_id": "big", "prompt": text, "max_tokens": 0, "prompt_logprobs": 20}) + "\n")
    engine = make_sql_engine(stack.db_url)
    try:
        submitted = submit_file(make_session_factory(engine), make_celery(broker_url), source, model)
    finally:
        engine.dispose()
    page = wait_for(
        lambda: (
            (rows := client.get("/v1/jobs", params={"batch_id": str(submitted.batch_id)}).json()["data"])
            and rows[0]["status"] in ("succeeded", "failed", "cancelled")
            and rows
        ),
        "the submitted job to end",
    )
    (job,) = page
    assert job["status"] == "failed" and job["error"]["code"] == "invalid_request", job
    assert f"{num_tokens:,} prompt tokens x (prompt_logprobs 20 + 1) x n 1" in job["error"]["message"]
    assert f"over this server's limit of {WORKER_LIMIT:,}" in job["error"]["message"]
