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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import BinaryIO

from celery import Celery
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.engine import SamplingParams
from tokenloom.openai_protocol.batch_input import BatchItem, BatchLineError, parse_line
from tokenloom.openai_protocol.batch_output import result_record
from tokenloom.store.batches.batch_finalizer import (
    echo_text,
    finalize_if_done,
    jobs_in_line_order,
    stored_prompt_logprobs,
)
from tokenloom.store.celery_app import send_jobs
from tokenloom.store.idempotency import insert_claim
from tokenloom.store.jobs.job_queries import QueueUnavailableError
from tokenloom.store.jobs.job_store import JobStore
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Batch, BatchStatus, IdempotencyKey, Job, JobErrorCode, JobStatus, utcnow

# Rows per INSERT statement: large enough that a 50,000-line batch is a few dozen round trips,
# small enough that a page of rows (prompts and messages included) is a few MB at most.
INSERT_PAGE_ROWS = 1000
# Every column a new job row may set (all producers fill each, None where unset), so each page
# is one executemany statement; priority, attempts and created_at take their column defaults.
NEW_JOB_COLUMNS = (
    "id",
    "project",
    "custom_id",
    "line_number",
    "input_hash",
    "model",
    "endpoint",
    "prompt",
    "prompt_token_ids",
    "messages",
    "params",
    "status",
    "error",
    "finished_at",
)


@dataclass(slots=True)
class SubmittedBatch:
    batch_id: uuid.UUID
    num_jobs: int
    num_invalid: int


def line_hash(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8", "surrogatepass")).hexdigest()


def submit_file(
    sessions: sessionmaker[Session],
    app: Celery,
    path: Path,
    model: str,
    project: str = "default",
    *,
    group_size: int = 1,
) -> SubmittedBatch:
    """`tokenloom submit`: the file is read line by line and inserted in pages (see submit_batch)."""
    batch = Batch(project=project, model=model, status=BatchStatus.IN_PROGRESS, in_progress_at=utcnow())
    with open(path, "rb") as src:
        submit_batch(sessions, app, batch, _jobs_for_file(src, model, project), group_size=group_size)
    return SubmittedBatch(batch.id, batch.total, batch.failed)


def _jobs_for_file(src: BinaryIO, model: str, project: str) -> Iterator[Job]:
    seen_custom_ids: set[str] = set()
    for number, raw in enumerate(src, start=1):
        line = raw.decode("utf-8", "replace").strip()
        if line:
            yield _job_for_line(parse_line(line, number), line, model, project, seen_custom_ids)


def submit_batch(
    sessions: sessionmaker[Session],
    app: Celery,
    batch: Batch,
    jobs: Iterable[Job],
    *,
    group_size: int = 1,
    admit: Callable[[int], None] | None = None,
    idempotency: IdempotencyKey | None = None,
) -> Batch:
    """Insert a batch and its job rows (lines that failed validation already `failed`) in one
    transaction, then queue the queued rows, `group_size` per message: the API's POST /v1/batches.

    `jobs` is consumed as it is inserted, INSERT_PAGE_ROWS rows per statement, so a 50,000-line
    batch never exists as 50,000 objects; an exception from it (a line that refuses the whole
    batch) or from `admit` (called with the number of queued rows before the commit) rolls
    everything back. Only the queued rows' ids are kept, to send them after the commit.

    If Redis refuses a message, the batch ends `failed` (with an error naming the cause), its
    unsent rows fail and the sent ones are cancelled, then QueueUnavailableError is raised.

    `idempotency`: the request's key row (store/idempotency.py), inserted right after the batch
    row; a key that a concurrent request took raises KeyTakenError before any job row is written.
    """
    model = batch.model
    if model is None:  # both callers name it; checked before anything is written
        raise ValueError("submit_batch needs batch.model: its jobs go on that model's queue")
    queued_ids: list[uuid.UUID] = []
    with sessions.begin() as session:
        session.add(batch)
        session.flush()
        if idempotency is not None:
            idempotency.batch_id = batch.id
            insert_claim(session, idempotency)
        batch.total = batch.failed = 0
        for page in _pages(jobs, INSERT_PAGE_ROWS):
            rows = [_insert_values(job, batch.id) for job in page]
            session.execute(insert(Job), rows)
            queued_ids += [row["id"] for row in rows if row["status"] is JobStatus.QUEUED]
            batch.total += len(rows)
        batch.failed = batch.total - len(queued_ids)
        if admit is not None:
            admit(len(queued_ids))
    if not queued_ids:  # every line was invalid: nothing will ever finish a job
        finalize_if_done(sessions, batch.id)
        return batch
    num_taken = 0

    def taken_ids() -> Iterator[uuid.UUID]:
        nonlocal num_taken
        for job_id in queued_ids:
            num_taken += 1
            yield job_id

    try:
        send_jobs(app, model, taken_ids(), group_size, WorkClass.BATCH)
    except Exception as exc:  # broker down: a half-sent batch is worse than a failed one
        # The group being sent when it failed may or may not have reached Redis: cancelling it
        # (with the sent ones) is safe either way.
        _fail_batch(sessions, batch, queued_ids[:num_taken], exc)
        raise QueueUnavailableError(f"the job queue (Redis) is unreachable: {exc}") from exc
    return batch


def _pages(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while page := list(islice(iterator, size)):
        yield page


def _insert_values(job: Job, batch_id: uuid.UUID) -> dict:
    """The columns a new row sets; the others (priority, attempts, created_at) take their defaults."""
    values = {name: getattr(job, name) for name in NEW_JOB_COLUMNS}
    values["batch_id"] = batch_id
    values["work_class"] = WorkClass.BATCH  # every row of a batch file is a batch line
    return values


def _fail_batch(sessions: sessionmaker[Session], batch: Batch, sent: list[uuid.UUID], exc: Exception) -> None:
    reason = f"could not be queued, the job queue (Redis) was unreachable: {exc}"
    store = JobStore(sessions)
    for page in _pages(sent, INSERT_PAGE_ROWS):
        store.request_cancel(page)
    now = utcnow()
    with sessions.begin() as session:
        # What is still queued now was never sent: the sent rows are cancelled (or running) by now.
        session.execute(
            update(Job)
            .where(Job.batch_id == batch.id, Job.status == JobStatus.QUEUED)
            .values(status=JobStatus.FAILED, finished_at=now, error=reason, error_code=JobErrorCode.QUEUE_UNAVAILABLE)
        )
        session.execute(
            update(Batch)
            .where(Batch.id == batch.id)
            .values(
                status=BatchStatus.FAILED,
                failed_at=now,
                errors=[{"code": "queue_unavailable", "message": reason, "param": None, "line": None}],
            )
        )


def _job_for_line(item: BatchItem | BatchLineError, line: str, model: str, project: str, seen: set[str]) -> Job:
    custom_id = item.custom_id
    job = Job(
        id=uuid.uuid4(),
        project=project,
        model=model,
        custom_id=custom_id,
        endpoint="/v1/completions",
        line_number=item.line_number,
        input_hash=line_hash(line),
        status=JobStatus.QUEUED,
        params={},
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
        job.error_code = JobErrorCode.INVALID_REQUEST
        return job
    assert isinstance(item, BatchItem)  # a BatchLineError's message is an error, returned above
    job.prompt = item.prompt if isinstance(item.prompt, str) else None
    job.prompt_token_ids = item.prompt if isinstance(item.prompt, list) else None
    job.messages = item.messages
    job.echo = item.echo
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
    return {
        "id": str(object_uuid),
        "kind": kind,
        "cancelled": cancelled,
        "cancelling": cancelling,
        "unchanged": len(job_ids) - cancelled - cancelling,
    }


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
    record = result_record(
        job.custom_id,
        line,
        job.model,
        job.status.value,
        job.choices or [],
        prompt_tokens=job.prompt_tokens,
        completion_tokens=job.completion_tokens or 0,
        ttft_s=job.ttft_s,
        tpot_s=job.tpot_s,
        queue_s=job.queue_s,
        e2e_s=job.e2e_seconds,
        error=job.error,
    )
    return {**record, "echo": echo_text(job), "prompt_logprobs": stored_prompt_logprobs(job)}


def batch_records(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> Iterator[dict]:
    """Every row's result line in line order, read a page of rows at a time."""
    with sessions() as session:
        for job in jobs_in_line_order(session, batch_id):
            yield job_record(job)
