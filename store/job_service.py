"""Turning input into job rows and rows back into result lines: shared by the CLI and the API.

Rows are inserted (status queued) in one transaction BEFORE any message is sent, so a message
always finds its row, and a row whose message was lost (Redis restart) can be re-sent from
Postgres. Lines that fail validation become rows that are failed from the start: they show up in
the results with their error and never reach a worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from celery import Celery
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.engine.batch_input import BatchItem, BatchLineError, parse_line
from tokenloom.engine.batch_output import result_record
from tokenloom.engine.sampling_params import SamplingParams
from tokenloom.store.batch_finalizer import finalize_if_done
from tokenloom.store.celery_app import send_job
from tokenloom.store.job_queries import QueueUnavailableError
from tokenloom.store.job_store import JobStore
from tokenloom.store.models import Batch, BatchStatus, Job, JobStatus, utcnow


@dataclass(slots=True)
class SubmittedBatch:
    batch_id: uuid.UUID
    num_jobs: int
    num_invalid: int


def line_hash(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8", "surrogatepass")).hexdigest()


def submit_file(
    sessions: sessionmaker[Session], app: Celery, path: Path, model: str, project: str = "default",
) -> SubmittedBatch:
    batch = Batch(project=project, model=model, status=BatchStatus.IN_PROGRESS, in_progress_at=utcnow())
    jobs: list[Job] = []
    seen_custom_ids: set[str] = set()
    with open(path, "rb") as src:
        for number, raw in enumerate(src, start=1):
            line = raw.decode("utf-8", "replace").strip()
            if line:
                jobs.append(_job_for_line(parse_line(line, number), line, model, project, seen_custom_ids))
    submit_batch(sessions, app, batch, jobs)
    return SubmittedBatch(batch.id, len(jobs), batch.failed)


def submit_batch(sessions: sessionmaker[Session], app: Celery, batch: Batch, jobs: list[Job]) -> Batch:
    """Insert a batch and its job rows (lines that failed validation already `failed`) in one
    transaction, then send one message per queued row: the API's POST /v1/batches.

    If Redis refuses a message, the batch ends `failed` (with an error naming the cause), its
    unsent rows fail and the sent ones are cancelled, then QueueUnavailableError is raised.
    """
    batch.total = len(jobs)
    batch.failed = sum(1 for j in jobs if j.status is JobStatus.FAILED)
    with sessions.begin() as session:
        session.add(batch)
        session.flush()
        for job in jobs:
            job.batch_id = batch.id
        session.add_all(jobs)
    queued = [job for job in jobs if job.status is JobStatus.QUEUED]
    for sent, job in enumerate(queued):
        try:
            send_job(app, job.id, job.model)
        except Exception as exc:  # broker down: a half-sent batch is worse than a failed one
            _fail_batch(sessions, batch, queued[:sent], queued[sent:], exc)
            raise QueueUnavailableError(f"the job queue (Redis) is unreachable: {exc}") from exc
    if not queued:  # every line was invalid: nothing will ever finish a job
        finalize_if_done(sessions, batch.id)
    return batch


def _fail_batch(sessions: sessionmaker[Session], batch: Batch, sent: list[Job], unsent: list[Job], exc: Exception) -> None:
    reason = f"could not be queued, the job queue (Redis) was unreachable: {exc}"
    JobStore(sessions).request_cancel([j.id for j in sent])
    now = utcnow()
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.id.in_([j.id for j in unsent]), Job.status == JobStatus.QUEUED)
                        .values(status=JobStatus.FAILED, finished_at=now, error=reason))
        session.execute(update(Batch).where(Batch.id == batch.id).values(
            status=BatchStatus.FAILED, failed_at=now,
            errors=[{"code": "queue_unavailable", "message": reason, "param": None, "line": None}]))


def _job_for_line(item: BatchItem | BatchLineError, line: str, model: str, project: str, seen: set[str]) -> Job:
    custom_id = item.custom_id
    job = Job(
        id=uuid.uuid4(), project=project, model=model, custom_id=custom_id,
        line_number=item.line_number, input_hash=line_hash(line), status=JobStatus.QUEUED, params={},
    )
    error = item.message if isinstance(item, BatchLineError) else None
    if error is None and custom_id in seen:
        error = f"duplicate custom_id {custom_id!r}: each line of a batch needs its own"
    if custom_id is not None and custom_id in seen:
        job.custom_id = None  # keep the (batch_id, custom_id) constraint for the first holder
    if custom_id is not None:
        seen.add(custom_id)
    if error is not None:
        job.status, job.error, job.finished_at = JobStatus.FAILED, error, utcnow()
        return job
    job.prompt = item.prompt if isinstance(item.prompt, str) else None
    job.prompt_token_ids = item.prompt if isinstance(item.prompt, list) else None
    job.messages = item.messages
    job.endpoint = "/v1/chat/completions" if item.messages is not None else "/v1/completions"
    job.params = _explicit_params(item.params)
    return job


def _explicit_params(params: SamplingParams) -> dict:
    """The fields that differ from SamplingParams() defaults; the worker fills the rest from its config."""
    defaults = SamplingParams()
    return {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(defaults, f.name)
    }


def status_counts(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> Counter:
    with sessions() as session:
        rows = session.execute(
            select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
        ).all()
    return Counter({status.value: count for status, count in rows})


def cancel(sessions: sessionmaker[Session], object_id: uuid.UUID | str) -> dict:
    """Cancel one job, or every job of a batch: queued ones never start, running ones are aborted
    in the engine by their worker and end cancelled with their partial output.

    Returns {"id", "kind" ("job"|"batch"), "cancelled" (ended now), "cancelling" (running, being
    aborted), "unchanged" (already finished)}. An unknown id raises LookupError.
    """
    try:
        object_uuid = object_id if isinstance(object_id, uuid.UUID) else uuid.UUID(str(object_id))
    except ValueError:
        raise LookupError(f"{object_id!r} is not a job or batch id (a UUID)") from None
    with sessions() as session:
        if session.get(Job, object_uuid) is not None:
            kind, job_ids = "job", [object_uuid]
        elif session.get(Batch, object_uuid) is not None:
            kind = "batch"
            job_ids = list(session.execute(select(Job.id).where(Job.batch_id == object_uuid)).scalars())
        else:
            raise LookupError(f"no job or batch with id {object_uuid}")
    cancelled, cancelling = JobStore(sessions).request_cancel(job_ids)
    if kind == "batch":
        _mark_batch_cancelling(sessions, object_uuid)
        # Nothing left running: finalize now (cancelling -> cancelled, with its files); otherwise
        # the worker that records the last aborted job does it.
        finalize_if_done(sessions, object_uuid)
    return {"id": str(object_uuid), "kind": kind, "cancelled": cancelled, "cancelling": cancelling,
            "unchanged": len(job_ids) - cancelled - cancelling}


def _mark_batch_cancelling(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> None:
    """OpenAI batch states: cancelling while jobs are being aborted; `finalize_if_done` makes it
    cancelled once none run. A batch already finalizing or ended is left as it is."""
    open_states = [BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING]
    with sessions.begin() as session:
        batch = session.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status not in open_states:
            return
        batch.cancelling_at = batch.cancelling_at or utcnow()
        batch.status = BatchStatus.CANCELLING


def job_record(job: Job) -> dict:
    """The same result line `tokenloom run` writes, from a finished row."""
    line = job.line_number or 0
    if job.status is not JobStatus.SUCCEEDED and not job.choices:
        return result_record(job.custom_id, line, job.model, job.status.value, [], error=job.error or job.status.value)
    e2e_s = None
    if job.finished_at is not None and job.created_at is not None:
        e2e_s = (job.finished_at - job.created_at).total_seconds()
    return result_record(
        job.custom_id, line, job.model, job.status.value, job.choices or [],
        prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens or 0,
        ttft_s=job.ttft_s, tpot_s=job.tpot_s, queue_s=job.queue_s, e2e_s=e2e_s, error=job.error,
    )


def batch_records(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> list[dict]:
    with sessions() as session:
        jobs = session.execute(select(Job).where(Job.batch_id == batch_id).order_by(Job.line_number)).scalars()
        return [job_record(job) for job in jobs]
