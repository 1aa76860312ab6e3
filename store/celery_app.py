"""The Celery application: Redis broker, one queue per model, late acks, bounded prefetch.

Reliability settings and why:
- acks_late + reject_on_worker_lost: a message is acked only after its job's row is final, so a
  worker that dies mid-job leaves the message to be delivered again.
- prefetch multiplier 1 with a thread pool sized to the engine's batch: a worker never reserves
  more jobs than its engine can run at once, leaving the rest for other workers.
- classes of work (store/jobs/work_class.py) are consumed in order: interactive jobs go to the
  model's interactive queue, which each worker drains on its own thread (worker/interactive_lane.py),
  so they never wait for a claim thread held by batch messages; jobs and batch lines share the
  model's queue at two of Kombu's Redis priority levels, and a worker takes every waiting job
  message before any batch message.
- jobs of dead workers come back through their expired row leases (worker/reconciler.py), within
  about `[queue] lease_s`, not through Redis. A message a worker received but died before
  claiming is held by Redis for the visibility timeout (10 min); the reconciler does not wait for
  it: a job still queued after 2 x lease_s while its class's lists (`class_queue_keys`) are empty is
  sent again, whatever the model's other classes hold.
  A job running longer than it is delivered a second time, and that copy is acked without work
  because the claim finds the job owned by a live worker.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import islice

from celery import Celery

from tokenloom.store.jobs.work_class import WorkClass

VISIBILITY_TIMEOUT_S = 600
# args: [list of job ids, work class]: one model's jobs of one class, claimed together.
RUN_JOBS_TASK = "tokenloom.run_jobs"
# Kombu's Redis transport keeps a queue's priority levels in separate lists next to the plain one
# (levels 0, 3, 6, 9), and a consumer pops them in that order: level 0 first.
PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
MESSAGE_PRIORITY = {WorkClass.JOBS: 0, WorkClass.BATCH: 9}  # on the model's queue
INTERACTIVE_SUFFIX = ".interactive"


def queue_name(model: str) -> str:
    """One queue per model name, e.g. 'tokenloom.qwen3-0.6b'."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model.rstrip("/").rsplit("/", 1)[-1]).strip("-") or "model"
    return f"tokenloom.{slug}"


def interactive_queue_name(model: str) -> str:
    """The model's queue of interactive jobs, e.g. 'tokenloom.qwen3-0.6b.interactive'."""
    return queue_name(model) + INTERACTIVE_SUFFIX


def queue_for(model: str, work_class: WorkClass) -> str:
    return interactive_queue_name(model) if work_class is WorkClass.INTERACTIVE else queue_name(model)


def queue_keys(model: str) -> list[str]:
    """The Redis lists that hold the model's waiting messages (every class and priority level)."""
    return [key for keys in class_queue_keys(model).values() for key in keys]


def class_queue_keys(model: str) -> dict[WorkClass, list[str]]:
    """Per class, the Redis lists that hold its waiting messages for `model`."""
    main = queue_name(model)
    return {
        WorkClass.INTERACTIVE: [interactive_queue_name(model) + suffix for suffix in PRIORITY_SUFFIXES],
        # Levels 3 and 6 are not sent to; a message there (another tool's) counts as a job's.
        WorkClass.JOBS: [main + suffix for suffix in PRIORITY_SUFFIXES[:3]],
        WorkClass.BATCH: [main + PRIORITY_SUFFIXES[3]],
    }


def make_celery(broker_url: str) -> Celery:
    app = Celery("tokenloom", broker=broker_url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a Redis restart delays work, never kills the worker
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app


def send_job(app: Celery, job_id, model: str, work_class: WorkClass = WorkClass.JOBS) -> None:
    send_jobs(app, model, [job_id], work_class=work_class)


def send_jobs(
    app: Celery, model: str, job_ids: Iterable, group_size: int = 1, work_class: WorkClass = WorkClass.JOBS
) -> int:
    """Put jobs of one class on their model's queue, `group_size` ids per message, over one broker connection.

    A worker claims a message's jobs in one UPDATE and records their results in groups, so a
    batch of short jobs costs a few round trips per group instead of several per job. Returns
    the number of messages sent. A group must not mix models or classes.
    """
    ids = (str(job_id) for job_id in job_ids)
    sent = 0
    queue = queue_for(model, work_class)
    priority = MESSAGE_PRIORITY.get(work_class)
    with app.producer_or_acquire() as producer:
        while group := list(islice(ids, max(1, group_size))):
            app.send_task(
                RUN_JOBS_TASK, args=[group, work_class.value], queue=queue, priority=priority, producer=producer
            )
            sent += 1
    return sent
