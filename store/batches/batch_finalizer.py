"""Batch finalization (OpenAI Batch API semantics): once every job of a batch is terminal, the
batch goes in_progress -> finalizing -> completed (cancelling -> finalizing -> cancelled), its
request counts are taken from the job rows and its output and error files are written.

`finalize_if_done` is called by every job thread that finishes a batch job, by `submit_file` and
by `cancel`, on any number of workers at once. A conditional UPDATE (batch still in_progress or
cancelling AND no non-terminal job left) moves the batch to finalizing; exactly one caller can
match it. That caller builds the files and writes the final status in the SAME transaction, so
concurrent callers wait on the row lock and then no longer match, and a crash part way rolls the
batch back to its open state for the next caller instead of leaving it stuck in finalizing.

Terminal job rows never change again (every job transition names the states it leaves), so the
rows read after winning are final. The files are written while the rows are read, a page of rows
and a chunk of output at a time (store/files/file_chunks.py), so a 50,000-request batch is never whole
in memory.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import timedelta

from sqlalchemy import exists, func, insert, select, tuple_, update
from sqlalchemy.orm import Session, defer, sessionmaker

from tokenloom.engine import expand_prompt_logprobs
from tokenloom.openai_protocol.openai_response import (
    StoredResult,
    batch_error_line,
    batch_expired_line,
    batch_output_line,
)
from tokenloom.openai_protocol.openai_response import completion_body as openai_body
from tokenloom.store.batches.batch_expiry import mark_aborted_lines_expired
from tokenloom.store.database import rowcount
from tokenloom.store.files.file_chunks import ChunkWriter
from tokenloom.store.models import (
    TERMINAL_JOB_STATUSES,
    Batch,
    BatchStatus,
    File,
    Job,
    JobErrorCode,
    JobStatus,
    utcnow,
)

log = logging.getLogger("tokenloom.worker")

OPEN_BATCH_STATUSES = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)
NON_TERMINAL_JOB_STATUSES = tuple(s for s in JobStatus if s not in TERMINAL_JOB_STATUSES)
PAGE_ROWS = 1000  # job rows per query while the output files are written


def finalize_if_done(sessions: sessionmaker[Session], batch_id: uuid.UUID | str) -> bool:
    """Finalize the batch if its last job has ended; True only for the one caller that did it."""
    batch_uuid = batch_id if isinstance(batch_id, uuid.UUID) else uuid.UUID(str(batch_id))
    now = utcnow()
    with sessions.begin() as session:
        unfinished = exists().where(Job.batch_id == batch_uuid, Job.status.in_(NON_TERMINAL_JOB_STATUSES))
        won = rowcount(
            session.execute(
                update(Batch)
                .where(Batch.id == batch_uuid, Batch.status.in_(OPEN_BATCH_STATUSES), ~unfinished)
                .values(status=BatchStatus.FINALIZING, finalizing_at=now)
                .execution_options(synchronize_session=False)
            )
        )
        if not won:
            return False
        batch = session.get(Batch, batch_uuid, populate_existing=True)
        if batch is None:  # the UPDATE above just matched it, in this transaction
            raise RuntimeError(f"batch {batch_uuid} vanished while it was being finalized")
        if batch.expired_at is not None:  # its window ended: what it did not reach is batch_expired
            mark_aborted_lines_expired(session, batch_uuid)
        counts: dict[JobStatus, int] = dict(
            session.execute(
                select(Job.status, func.count()).where(Job.batch_id == batch_uuid).group_by(Job.status)
            ).all()
        )
        total = sum(counts.values())
        succeeded, failed = counts.get(JobStatus.SUCCEEDED, 0), counts.get(JobStatus.FAILED, 0)

        output = _new_file(session, batch, "batch_output", "output")
        error = _new_file(session, batch, "batch_error", "error") if failed else None
        for job in jobs_in_line_order(session, batch_uuid, (JobStatus.SUCCEEDED, JobStatus.FAILED)):
            if job.status is JobStatus.SUCCEEDED:
                output.write(_jsonl(output_line(job)))
            else:
                if error is None:  # `counts` found no failed line; lines of an ended batch do not change
                    raise RuntimeError(f"batch {batch_uuid}: a failed line that was not counted")
                error.write(_jsonl(error_line(job)))
        _close(session, output)
        if error is not None:
            _close(session, error)

        done = utcnow()
        batch.total = total
        batch.completed = succeeded
        batch.failed = failed
        batch.output_file_id = output.file_id
        batch.error_file_id = error.file_id if error is not None else None
        if batch.expired_at is not None:
            batch.status = BatchStatus.EXPIRED
        elif batch.cancelling_at is not None:  # it was being cancelled
            batch.status, batch.cancelled_at = BatchStatus.CANCELLED, done
        else:
            batch.status, batch.completed_at = BatchStatus.COMPLETED, done
    log.info("batch %s finalized: %d succeeded, %d failed of %d", batch_uuid, succeeded, failed, total)
    return True


def jobs_in_line_order(
    session: Session,
    batch_id: uuid.UUID,
    statuses: tuple[JobStatus, ...] | None = None,
) -> Iterator[Job]:
    """The batch's rows by line number, PAGE_ROWS per query (keyset on line_number, id; index
    ix_jobs_batch_id_line_number), so only one page is in memory. Every producer of batch rows
    sets line_number. A page comes without prompt logprobs (each line's can be [server]
    max_prompt_logprob_entries entries): a row that asked for them reads its own when they are used
    (asked_prompt_logprobs), and lets them go once the caller moves on to the next row."""
    query = (
        select(Job)
        .options(defer(Job.prompt_logprobs))
        .where(Job.batch_id == batch_id)
        .order_by(Job.line_number, Job.id)
        .limit(PAGE_ROWS)
    )
    if statuses is not None:
        query = query.where(Job.status.in_(statuses))
    after = None
    while True:
        page_query = query if after is None else query.where(tuple_(Job.line_number, Job.id) > after)
        page = session.execute(page_query).scalars().all()
        for job in page:
            yield job
            session.expire(job, ["prompt_logprobs"])  # read for this row alone, if it was: not kept with the page
        if len(page) < PAGE_ROWS:
            return
        after = (page[-1].line_number, page[-1].id)


def _new_file(session: Session, batch: Batch, purpose: str, kind: str) -> ChunkWriter:
    file_id = f"file-{uuid.uuid4().hex}"
    created = utcnow()
    expires = (
        None if batch.output_expires_after_s is None else created + timedelta(seconds=batch.output_expires_after_s)
    )
    session.execute(
        insert(File).values(
            id=file_id,
            project=batch.project,
            purpose=purpose,
            filename=f"batch_{batch.id}_{kind}.jsonl",
            bytes=0,
            created_at=created,
            expires_at=expires,
        )
    )
    return ChunkWriter(session, file_id)


def _close(session: Session, writer: ChunkWriter) -> None:
    writer.close()
    session.execute(update(File).where(File.id == writer.file_id).values(bytes=writer.num_bytes))


def _jsonl(line: dict) -> bytes:
    return (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")


def output_line(job: Job) -> dict:
    """One line of an OpenAI batch output file, for a succeeded job."""
    return batch_output_line(job.id.hex, job.custom_id, str(job.id), completion_body(job))


def error_line(job: Job) -> dict:
    """One line of an OpenAI batch error file, for a failed job."""
    if job.error_code is JobErrorCode.BATCH_EXPIRED:
        return batch_expired_line(job.id.hex, job.custom_id, job.error or "batch expired")
    return batch_error_line(job.id.hex, job.custom_id, str(job.id), job.error or "failed")


def completion_body(job: Job) -> dict:
    """The chat.completion or text_completion object an online request would have returned."""
    chat = job.endpoint == "/v1/chat/completions" or job.messages is not None
    stored = job.choices or [{"index": 0, "text": job.output_text or "", "finish_reason": job.finish_reason}]
    finished = job.finished_at or job.created_at
    return openai_body(
        StoredResult(
            id_hex=job.id.hex,
            chat=chat,
            created=int(finished.timestamp()) if finished is not None else 0,
            model=job.model,
            choices=stored,
            prompt_tokens=job.prompt_tokens or 0,
            completion_tokens=job.completion_tokens or 0,
            echo_text=echo_text(job),
            prompt_logprobs=stored_prompt_logprobs(job),
        )
    )


def asked_prompt_logprobs(job: Job) -> bool:
    """Whether the row may hold prompt logprobs (its request asked for them, or echo with logprobs did):
    only those rows' are read, so a page of rows that did not ask costs no query per row."""
    return (job.params or {}).get("prompt_logprobs") is not None


def stored_prompt_logprobs(job: Job) -> list[dict] | None:
    """The row's prompt logprobs as clients get them (expanded from their stored form), or None if not asked."""
    return expand_prompt_logprobs(job.prompt_logprobs) if asked_prompt_logprobs(job) else None


def echo_text(job: Job) -> str | None:
    """The prompt's text for a job that asked for `echo` (the API stores it, decoded from token ids
    where the request gave ids; spelled from its prompt logprobs for a row queued without it)."""
    if not job.echo:
        return None
    if job.prompt is not None:
        return job.prompt
    return "".join(entry.get("token", "") for entry in stored_prompt_logprobs(job) or [])
