"""Where each class of work is sent, and in which order a worker takes it (real Redis)."""

from __future__ import annotations

import uuid

import pytest
import redis

from tokenloom.store.celery_app import (
    class_queue_keys,
    interactive_queue_name,
    make_celery,
    queue_keys,
    queue_name,
    send_jobs,
)
from tokenloom.store.jobs.work_class import CLASS_STRIDE, PRIORITY_LIMIT, WorkClass

BROKER = "redis://127.0.0.1:6379/0"


@pytest.fixture
def model():
    name = f"routing-{uuid.uuid4().hex[:8]}"  # its own queues: nothing else consumes them
    yield name
    client = redis.Redis.from_url(BROKER)
    client.delete(*queue_keys(name))
    client.close()


def _take_all(app, queue: str) -> list[tuple[list[str], str]]:
    """Consume `queue` as a worker does (Kombu pops the priority levels in order): (ids, class) per message."""
    taken = []
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue)
        while True:
            try:
                message = simple.get(timeout=0.5)
            except simple.Empty:
                break
            args = message.payload[0]
            taken.append((args[0], args[1]))
            message.ack()
        simple.close()
    return taken


def test_jobs_are_taken_before_batch_lines_sent_earlier(model):
    app = make_celery(BROKER)
    batch_ids = [str(uuid.uuid4()) for _ in range(6)]
    job_ids = [str(uuid.uuid4()) for _ in range(2)]
    assert send_jobs(app, model, batch_ids, 3, WorkClass.BATCH) == 2
    assert send_jobs(app, model, job_ids, 1, WorkClass.JOBS) == 2
    taken = _take_all(app, queue_name(model))
    assert taken == [([job_ids[0]], "jobs"), ([job_ids[1]], "jobs"), (batch_ids[:3], "batch"), (batch_ids[3:], "batch")]


def test_interactive_jobs_go_to_the_interactive_queue_and_are_counted_per_class(model):
    app = make_celery(BROKER)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    send_jobs(app, model, ids, 1, WorkClass.INTERACTIVE)
    send_jobs(app, model, [str(uuid.uuid4())], 1, WorkClass.BATCH)
    client = redis.Redis.from_url(BROKER)
    depths = {work_class: sum(client.llen(key) for key in keys) for work_class, keys in class_queue_keys(model).items()}
    client.close()
    assert depths == {WorkClass.INTERACTIVE: 3, WorkClass.JOBS: 0, WorkClass.BATCH: 1}
    assert _take_all(app, interactive_queue_name(model)) == [([job_id], "interactive") for job_id in ids]
    assert [work_class for _, work_class in _take_all(app, queue_name(model))] == ["batch"]


def test_any_interactive_request_outranks_any_job_and_any_batch_line_in_the_engine():
    worst_interactive = WorkClass.INTERACTIVE.engine_priority(PRIORITY_LIMIT)
    best_job, worst_job = (
        WorkClass.JOBS.engine_priority(-PRIORITY_LIMIT),
        WorkClass.JOBS.engine_priority(PRIORITY_LIMIT),
    )
    assert worst_interactive < best_job <= worst_job < WorkClass.BATCH.engine_priority(-PRIORITY_LIMIT)
    assert WorkClass.JOBS.engine_priority(-5) < WorkClass.JOBS.engine_priority(0)  # priority orders within a class
    assert WorkClass.BATCH.engine_priority(10**9) == 2 * CLASS_STRIDE + PRIORITY_LIMIT  # clamped into its class


@pytest.mark.parametrize(
    ("endpoint", "tier", "expected"),
    [
        (WorkClass.INTERACTIVE, None, WorkClass.INTERACTIVE),
        (WorkClass.INTERACTIVE, "auto", WorkClass.INTERACTIVE),
        (WorkClass.INTERACTIVE, "flex", WorkClass.BATCH),
        (WorkClass.JOBS, "default", WorkClass.JOBS),
        (WorkClass.JOBS, "priority", WorkClass.INTERACTIVE),
        (WorkClass.JOBS, "scale", WorkClass.JOBS),
    ],
)
def test_service_tier_maps_onto_a_class(endpoint, tier, expected):
    assert WorkClass.for_request(endpoint, tier) is expected
