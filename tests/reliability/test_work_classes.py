"""Classes of work through a real worker process, Redis and Postgres (issue 36's behaviours).

- An interactive job sent while a batch saturates the worker (every claim thread holding a batch
  message, every engine slot taken) is claimed through the interactive lane and admitted by
  preempting a batch sequence: it ends while the batch has barely moved.
- Two projects' batches, one submitted after the other, progress together (fair claims).
- A worker killed while it holds interactive jobs and batch lines: a new worker finishes every
  one exactly once, with the greedy tokens of an undisturbed run.
- A batch sent under a chat stream that alone fills the engine still finishes, on the seats each
  class is owed ([scheduler] min_seat_share), while the stream goes on.
"""

from __future__ import annotations

import socket
import uuid

import pytest
import redis

from tests.reliability.conftest import (
    STALL_MARKER,
    count_status,
    expected_tokens,
    job_lines,
    jobs_of,
    stalling,
    submit,
    wait_all_terminal,
    wait_until,
    worker_settings,
)
from tests.services import start_worker
from tokenloom.store.celery_app import make_celery
from tokenloom.store.engine_stats import ENGINE_STATS_PREFIX
from tokenloom.store.jobs import job_queries
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus

MAX_NUM_SEQS = 4
CLAIMED_AT_ONCE = 2 * MAX_NUM_SEQS  # a worker's claim window (worker/runtime.py)
CLAIM_THREADS = 4
# A stream's open jobs: two claim windows and every claim thread's message, so its messages never run out at Redis.
STREAM_OPEN = 2 * CLAIMED_AT_ONCE + CLAIM_THREADS


def _interactive_jobs(
    sessions, broker_url: str, model: str, prompts: list[str], max_tokens: int, work_class=WorkClass.INTERACTIVE
) -> list[uuid.UUID]:
    """Rows and messages as the synchronous API (or /v1/jobs, with WorkClass.JOBS) makes them
    (api/job_request.py), without an HTTP hop."""
    jobs = [
        Job(
            id=uuid.uuid4(),
            project="chat",
            model=model,
            endpoint="/v1/completions",
            prompt=prompt,
            status=JobStatus.QUEUED,
            work_class=work_class,
            params={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        for prompt in prompts
    ]
    job_queries.enqueue_jobs(sessions, make_celery(broker_url), jobs)
    return [job.id for job in jobs]


def _rows(sessions, ids: list[uuid.UUID]) -> list[Job]:
    with sessions() as session:
        return [session.get(Job, job_id) for job_id in ids]


def _finished(sessions, batch_id: uuid.UUID) -> int:
    return count_status(sessions, batch_id, JobStatus.SUCCEEDED)


def _preemptions(broker_url: str) -> int:
    client = redis.Redis.from_url(broker_url)
    try:
        return sum(int(client.hget(key, "preemptions") or 0) for key in client.scan_iter(ENGINE_STATS_PREFIX + "*"))
    finally:
        client.close()


def test_an_interactive_job_sent_during_a_saturating_batch_runs_at_once(
    fault_checkpoint, pg_db, sessions, redis_server, tmp_path
):
    # Stalled lines: each engine step holding one sleeps, so the batch lasts minutes on any CPU.
    lines = job_lines(60, max_tokens=400, stalled=True)
    # A short lease: the heartbeat that publishes the engine's counters comes every lease_s / 3.
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS, queue_lease_s=6)
    worker = start_worker(stalling(settings), CLAIM_THREADS, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
        # Saturated: the claim window is full, so every claim thread waits with a batch message.
        wait_until(
            lambda: count_status(sessions, batch_id, JobStatus.RUNNING) >= CLAIMED_AT_ONCE,
            120,
            "the worker to hold a full claim window of batch lines",
        )
        finished_before = _finished(sessions, batch_id)
        [chat_id] = _interactive_jobs(sessions, redis_server.url, str(fault_checkpoint), ["hello there"], 8)
        wait_until(
            lambda: _rows(sessions, [chat_id])[0].status is JobStatus.SUCCEEDED, 120, "the interactive job to finish"
        )
        finished_during = _finished(sessions, batch_id) - finished_before
        # It took a batch sequence's place in the full engine (the counter comes with a heartbeat).
        wait_until(lambda: _preemptions(redis_server.url) >= 1, 60, "the engine to report a preemption")
    finally:
        worker.stop()
    # Without the lane it waits for a claim thread, which frees only after a window's worth of
    # lines end; without priority scheduling it waits for a running line to end (400 stalled
    # tokens): either way many lines end first.
    assert finished_during < MAX_NUM_SEQS, finished_during


def test_two_projects_batches_progress_together(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS)
    num_lines = 48
    worker = start_worker(settings, CLAIM_THREADS, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        first = submit(
            sessions,
            redis_server.url,
            fault_checkpoint,
            job_lines(num_lines, 48, prefix="a"),
            tmp_path,
            project="tenant-a",
        )
        second = submit(
            sessions,
            redis_server.url,
            fault_checkpoint,
            job_lines(num_lines, 48, prefix="b"),
            tmp_path,
            project="tenant-b",
        )
        jobs = {batch: wait_all_terminal(sessions, batch, num_lines, timeout_s=300) for batch in (first, second)}
    finally:
        worker.stop()
    assert all(j.status is JobStatus.SUCCEEDED for batch_jobs in jobs.values() for j in batch_jobs)
    ends = {batch: sorted(j.finished_at for j in batch_jobs) for batch, batch_jobs in jobs.items()}
    first_done = min(ends[first][-1], ends[second][-1])
    done = {batch: sum(t <= first_done for t in times) for batch, times in ends.items()}
    # When one batch ends the other is about as far: first come is not first served. (The first
    # holds a head start of at most one claim window, claimed before the second was sent.)
    assert 0.5 <= done[second] / done[first] <= 2, done
    assert min(done.values()) >= num_lines - CLAIMED_AT_ONCE - MAX_NUM_SEQS, done


def test_a_worker_killed_holding_both_classes_loses_and_duplicates_nothing(
    fault_checkpoint, pg_db, sessions, redis_server, tmp_path
):
    lines = job_lines(8, max_tokens=300, stalled=True)
    chats = [f"{STALL_MARKER} chat {i}" for i in range(3)]
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS, queue_lease_s=4)
    first = start_worker(stalling(settings), CLAIM_THREADS, tmp_path / "first.log")
    first.wait_ready()
    batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
    chat_ids = _interactive_jobs(sessions, redis_server.url, str(fault_checkpoint), chats, 300)
    first_id = f"{socket.gethostname()}:{first.process.pid}"
    wait_until(
        lambda: (
            all(j.status is JobStatus.RUNNING and j.worker_id == first_id for j in _rows(sessions, chat_ids))
            and count_status(sessions, batch_id, JobStatus.RUNNING)
        ),
        120,
        "the first worker to hold interactive jobs and batch lines",
    )
    first.process.kill()
    first.process.wait()

    second = start_worker(settings, CLAIM_THREADS, tmp_path / "second.log")
    try:
        second.wait_ready()
        batch_jobs = wait_all_terminal(sessions, batch_id, len(lines), timeout_s=240)
        wait_until(
            lambda: all(j.status is JobStatus.SUCCEEDED for j in _rows(sessions, chat_ids)),
            240,
            "the interactive jobs to finish on the new worker",
        )
    finally:
        second.stop()
    chat_jobs = _rows(sessions, chat_ids)
    assert [j.status for j in batch_jobs] == [JobStatus.SUCCEEDED] * len(lines), [j.error for j in batch_jobs]
    assert all(j.attempts == 2 for j in chat_jobs), [j.attempts for j in chat_jobs]  # re-run once, not twice
    expected = expected_tokens(fault_checkpoint, lines)
    assert {j.custom_id: j.output_token_ids for j in batch_jobs} == expected
    assert all(j.work_class is WorkClass.INTERACTIVE and len(j.output_token_ids) == 300 for j in chat_jobs)
    assert len(jobs_of(sessions, batch_id)) == len(lines)


@pytest.mark.parametrize("stream_class", [WorkClass.INTERACTIVE, WorkClass.JOBS], ids=["chat", "jobs"])
def test_a_batch_finishes_under_a_stream_that_alone_fills_the_engine(
    fault_checkpoint, pg_db, sessions, redis_server, tmp_path, stream_class
):
    # Stalled chats or /v1/jobs work (each engine step holding one sleeps), STREAM_OPEN kept open all
    # along (more than the worker can hold: messages always wait at Redis): with strict priority they alone would hold every seat and the batch would never run.
    # With the default [scheduler] min_seat_share (0.1: one of 4 seats owed to each class) it ends;
    # under jobs, whose messages go before batch messages at Redis, it also takes the claim window's
    # share owed to batch lines without their messages (worker/owed_batch_claims.py).
    lines = job_lines(3, max_tokens=16)
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS)
    worker = start_worker(stalling(settings), CLAIM_THREADS, tmp_path / "worker.log")
    stream: list[uuid.UUID] = []
    try:
        worker.wait_ready()
        model = str(fault_checkpoint)

        def top_up() -> None:
            open_chats = sum(not j.status.is_terminal for j in _rows(sessions, stream))
            prompts = [f"{STALL_MARKER} chat {len(stream) + i}" for i in range(STREAM_OPEN - open_chats)]
            if prompts:
                stream.extend(_interactive_jobs(sessions, redis_server.url, model, prompts, 40, stream_class))

        top_up()
        wait_until(
            lambda: top_up() or sum(j.status is JobStatus.RUNNING for j in _rows(sessions, stream)) >= MAX_NUM_SEQS,
            120,
            "the chat stream to fill the engine",
        )
        chats_done_before = sum(j.status is JobStatus.SUCCEEDED for j in _rows(sessions, stream))
        batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
        wait_until(
            lambda: top_up() or count_status(sessions, batch_id, JobStatus.SUCCEEDED) == len(lines),
            240,
            "the batch to finish while the stream goes on",
        )
        chats = _rows(sessions, stream)
    finally:
        worker.stop()
    # The stream never stopped: chats went on finishing while the batch ran, and more were waiting.
    assert sum(j.status is JobStatus.SUCCEEDED for j in chats) > chats_done_before
    assert sum(not j.status.is_terminal for j in chats) >= MAX_NUM_SEQS
    batch_jobs = jobs_of(sessions, batch_id)
    assert {j.custom_id: j.output_token_ids for j in batch_jobs} == expected_tokens(fault_checkpoint, lines)
