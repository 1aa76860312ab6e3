"""A real Celery worker process (Redis broker, Postgres rows, a tiny real model), driven by the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import engine_config
from tests.services import REPO_ROOT as ROOT
from tests.services import running_worker
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.files.file_chunks import read_chunks
from tokenloom.store.models import Batch, BatchStatus, Job

NUM_CONCURRENT_JOBS = 32
# The overlap test's prompts carry the engine's stall marker (engine/testing/fault_injection.py, armed for
# this worker): each job then takes >= MAX_TOKENS * STALL_STEP_S = 3.2 s however fast the CPU, far
# longer than claiming the batch's messages takes, so the jobs are in the engine together.
STALL_MARKER = "~STALL~"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def worker_env(pg_url, llama_checkpoint, tmp_path_factory):
    settings = {
        "TOKENLOOM_MODEL_NAME": str(llama_checkpoint),
        "TOKENLOOM_MODEL_DTYPE": "float32",
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": "128",
        "TOKENLOOM_DATABASE_URL": pg_url,
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": str(NUM_CONCURRENT_JOBS),
        "TOKENLOOM_FAULT_INJECT_PROMPT": f"stall:{STALL_MARKER}",
    }
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    with running_worker(settings, NUM_CONCURRENT_JOBS + 8, log_path) as env:
        yield env


def _submit(env, lines: list[dict], tmp_path: Path) -> tuple[uuid.UUID, list[dict]]:
    source = tmp_path / "batch.jsonl"
    source.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    output = tmp_path / "results.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "submit", str(source), "--wait", "-o", str(output), "--timeout", "300"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    batch_id = uuid.UUID(done.stdout.strip().splitlines()[-1])
    return batch_id, [json.loads(line) for line in output.read_text().splitlines()]


def _prompts(n: int) -> list[str]:
    return [f"{STALL_MARKER} job {i}: the engine reads {'many ' * (i % 7)}prompts" for i in range(n)]


def test_jobs_run_concurrently_in_one_worker_and_match_the_in_process_engine(
    worker_env, pg_url, llama_checkpoint, tmp_path
):
    prompts = _prompts(NUM_CONCURRENT_JOBS)
    lines = [
        {"custom_id": f"c{i}", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        for i, p in enumerate(prompts)
    ]
    batch_id, results = _submit(worker_env, lines, tmp_path)

    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(NUM_CONCURRENT_JOBS)]
    assert all(r["status"] == "succeeded" for r in results), [r["error"] for r in results if r["error"]]
    engine = Engine(engine_config(llama_checkpoint, model=dict(max_model_len=128)))
    expected = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [r["token_ids"] for r in results] == [o.outputs[0].token_ids for o in expected]
    assert all(r["ttft_s"] is not None and r["tpot_s"] is not None for r in results)

    sessions = make_session_factory(make_sql_engine(pg_url))
    with sessions() as session:
        jobs = session.execute(select(Job).where(Job.batch_id == batch_id)).scalars().all()
    # Continuous batching across jobs: at some instant most jobs were in the engine together.
    assert _max_overlap([(j.admitted_at, j.finished_at) for j in jobs]) >= NUM_CONCURRENT_JOBS // 2
    assert {j.attempts for j in jobs} == {1}
    # The worker finalized the batch once its last job ended (OpenAI batch output file).
    assert _finalized_batch(sessions, batch_id) == (BatchStatus.COMPLETED, NUM_CONCURRENT_JOBS, NUM_CONCURRENT_JOBS)


def test_bad_lines_fail_alone(worker_env, tmp_path):
    lines = [
        {"custom_id": "good", "prompt": "hello", "max_tokens": 5, "temperature": 0},
        "{not json",
        {"custom_id": "too-long", "prompt": "word " * 400, "max_tokens": 5},
        {"custom_id": "bad-param", "prompt": "hello", "temperature": -1},
        {"custom_id": "good-2", "prompt": "hello again", "max_tokens": 5, "temperature": 0},
    ]
    _, results = _submit(worker_env, lines, tmp_path)
    by_id = {r["custom_id"]: r for r in results}
    assert [r["status"] for r in results] == ["succeeded", "failed", "failed", "failed", "succeeded"]
    assert "max_model_len" in by_id["too-long"]["error"]["message"]
    assert "temperature" in by_id["bad-param"]["error"]["message"]
    assert len(by_id["good"]["token_ids"]) >= 1


def _finalized_batch(sessions, batch_id: uuid.UUID, timeout_s: float = 60.0):
    """(status, completed, output file lines) once the batch leaves in_progress/finalizing."""
    deadline = time.monotonic() + timeout_s
    while True:
        with sessions() as session:
            batch = session.get(Batch, batch_id)
            done = batch.status not in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING)
            if done or time.monotonic() > deadline:
                output = b"".join(read_chunks(sessions, batch.output_file_id)) if batch.output_file_id else None
                lines = len(output.splitlines()) if output is not None else None
                return batch.status, batch.completed, lines
        time.sleep(0.1)


def _max_overlap(intervals) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    best = current = 0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best
