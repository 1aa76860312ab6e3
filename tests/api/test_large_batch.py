"""A 20,000-line batch end to end (the path a 1,000,000-line batch takes: bench/million_lines.py runs
that size): uploaded through the `openai` SDK, validated, its rows inserted, claimed fairly by two
worker processes, recorded, and written to an output file, while GET /v1/batches/{id} reports its
progress. Every line comes back exactly once, in line order, and the batch's request counts and
usage equal the sums over its lines."""

from __future__ import annotations

import json
import time
import uuid

import openai
import pytest
from sqlalchemy import func, select

from tests.api.conftest import MAX_MODEL_LEN, ThreadedServer, free_port, stack_config
from tests.conftest import ORACLE_CONFIG
from tests.services import fresh_pg_database, running_worker
from tokenloom.api.app import create_app
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.store import migrate
from tokenloom.store.api_keys.key_queries import create_key
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.models import Job

pytestmark = pytest.mark.slow

LINES = 20_000
MAX_TOKENS = 2
WORKERS = 2


@pytest.fixture(scope="module")
def big_stack(tmp_path_factory):
    # A checkpoint of its own: its name is its queue's, and the session's API stack (another
    # database) runs a worker on the shared checkpoint's queue in the same Redis.
    root = tmp_path_factory.mktemp("large-batch-model")
    api_checkpoint = build_random_checkpoint(root / f"corpus-llama-{uuid.uuid4().hex[:8]}", seed=0, **ORACLE_CONFIG)
    with fresh_pg_database() as db_url:
        migrate.upgrade(db_url)
        sessions = make_session_factory(make_sql_engine(db_url))
        key, _ = create_key(sessions, "corpus")
        settings = {
            "TOKENLOOM_MODEL_NAME": str(api_checkpoint),
            "TOKENLOOM_MODEL_DTYPE": "float32",
            "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "TOKENLOOM_DATABASE_URL": db_url,
            "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": "64",
            "TOKENLOOM_QUEUE_GROUP_SIZE": "64",
        }
        config = stack_config(api_checkpoint, db_url).replace(
            "server", max_batch_lines=LINES, max_file_mb=16, max_body_mb=16, max_queued_batch_lines=LINES
        )
        logs = tmp_path_factory.mktemp("large-batch")
        port = free_port()
        with (
            running_worker(settings, 8, logs / "worker-0.log"),
            running_worker(settings, 8, logs / "worker-1.log"),
            ThreadedServer(create_app(config), port),
        ):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
            yield client, sessions, str(api_checkpoint)


def test_a_20000_line_batch_comes_back_whole_in_line_order_with_exact_counts(big_stack):
    client, sessions, model = big_stack
    lines = [
        {
            "custom_id": f"line-{i:05d}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": f"document {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True},
        }
        for i in range(LINES)
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("corpus.jsonl", body), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    progress = []
    deadline = time.monotonic() + 900
    while (current := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"{current.request_counts} after 900 s"
        progress.append(current.request_counts.completed)
        time.sleep(0.5)
    assert current.status == "completed", current
    assert progress == sorted(progress) and len(set(progress)) > 2  # progress was reported as it went
    counts, usage = current.request_counts, current.usage
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
    assert usage.output_tokens == LINES * MAX_TOKENS
    with sessions() as session:
        assert usage.input_tokens == session.execute(select(func.sum(Job.prompt_tokens))).scalar_one()
        # Exactly once: every line ran once (one attempt), and the two workers shared them.
        attempts = dict(session.execute(select(Job.attempts, func.count()).group_by(Job.attempts)).all())
        workers = session.execute(select(func.count(func.distinct(Job.worker_id)))).scalar_one()
    assert attempts == {1: LINES} and workers == WORKERS
    output = [json.loads(line) for line in client.files.content(current.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in lines]
    assert all(line["response"]["status_code"] == 200 for line in output)
