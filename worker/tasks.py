"""Celery tasks: thin wrappers that hand a message's job ids to the process's JobRunner."""

from __future__ import annotations

from celery import Celery
from celery.exceptions import Reject

from tokenloom.settings.config import TokenloomConfig
from tokenloom.store.celery_app import RUN_JOBS_TASK
from tokenloom.store.db_retry import is_outage
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.worker.job_runner import NotAdmitting
from tokenloom.worker.runtime import get_runtime


def register_tasks(app: Celery, config: TokenloomConfig) -> None:
    @app.task(name=RUN_JOBS_TASK, acks_late=True, reject_on_worker_lost=True)
    def run_jobs_task(job_ids: list[str], work_class: str = WorkClass.JOBS.value) -> dict[str, int]:
        try:
            return get_runtime(config, app).runner.run(job_ids, WorkClass(work_class))
        except NotAdmitting:
            # Shutting down: the message goes back to the queue for another (or the next) worker.
            raise Reject("worker shutting down", requeue=True) from None
        except Exception as exc:
            if is_outage(exc):  # the database stayed down past [database] retry_s: try again later
                raise Reject(f"database unavailable: {exc}", requeue=True) from exc
            raise
