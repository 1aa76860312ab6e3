"""Celery tasks: thin wrappers that hand a job id to the process's JobRunner."""

from __future__ import annotations

from celery import Celery

from engine.config import TokenloomConfig
from worker.celery_app import RUN_JOB_TASK
from worker.runtime import get_runtime


def register_tasks(app: Celery, config: TokenloomConfig) -> None:
    @app.task(name=RUN_JOB_TASK, acks_late=True, reject_on_worker_lost=True)
    def run_job_task(job_id: str) -> str:
        return get_runtime(config, app).runner.run(job_id).value
