"""/v1/batches (OpenAI Batches API): create a batch from an uploaded file, read, list, cancel.

Creating a batch reads the stored file chunk by chunk, checks each line (api/batches/batch_file.py,
api/batches/batch_jobs.py) and inserts the batch with one job row per line, in pages, in one transaction
before any message is sent: a line that refuses the batch rolls every row back, and the batch is
`in_progress` when the response leaves (`validating` is never observed). The workers finalize it
(store/batches/batch_finalizer.py): `completed` (or `cancelled`) with output and error files.
"""

from __future__ import annotations

import uuid
from contextlib import closing
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response
from starlette.concurrency import run_in_threadpool

from tokenloom.api.admission import admit_batch_lines
from tokenloom.api.batches.batch_file import parse_batch_lines
from tokenloom.api.batches.batch_jobs import jobs_for_lines
from tokenloom.api.batches.batch_schemas import BatchCreate, BatchPage, BatchPublic, completion_window_seconds
from tokenloom.api.deps import Caller, State
from tokenloom.api.errors import DATABASE_RETRY_AFTER_S, ApiError, file_not_found
from tokenloom.api.idempotency import (
    REPLAYED_HEADERS,
    IdempotencyKeyHeader,
    create_once,
    idempotency_claim,
    replay_not_found,
)
from tokenloom.api.state import ApiState
from tokenloom.store.batches import batch_queries
from tokenloom.store.files import file_chunks, file_queries
from tokenloom.store.idempotency import IdempotencyClaim
from tokenloom.store.jobs.job_queries import QueueUnavailableError
from tokenloom.store.jobs.job_service import cancel, submit_batch
from tokenloom.store.models import Batch, BatchStatus, utcnow

router = APIRouter(prefix="/v1/batches", tags=["batches"])

CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)


@router.post("", response_model=BatchPublic)
async def create_batch(
    body: BatchCreate, state: State, caller: Caller, response: Response, idempotency_key: IdempotencyKeyHeader = None
) -> BatchPublic:
    """Run every line of `input_file_id` (purpose "batch") through `endpoint`. Lines that fail
    validation become failed requests in the error file; the others are queued. With an
    `Idempotency-Key`, a retry returns the batch the first request created."""
    claim = idempotency_claim(idempotency_key, caller, "/v1/batches", body.model_dump(mode="json", exclude_none=True))

    def replay(previous) -> BatchPublic:
        if (
            previous.batch_id is None
            or batch_queries.visible_batch(state.sessions, previous.batch_id, caller.project) is None
        ):
            raise replay_not_found(claim, "batch")
        return _public(state, previous.batch_id, caller)

    batch, replayed = await run_in_threadpool(
        create_once, state.sessions, claim, lambda: _create(state, caller, body, claim), replay
    )
    if replayed:
        response.headers.update(REPLAYED_HEADERS)
    return batch


def _create(state: ApiState, caller, body: BatchCreate, claim: IdempotencyClaim | None = None) -> BatchPublic:
    scope = _scope(caller)
    meta = file_queries.visible_file(state.sessions, body.input_file_id, scope)
    if meta is None:
        raise file_not_found(body.input_file_id, caller)
    if meta.purpose != "batch":
        raise ApiError(
            400,
            f'file {meta.id} has purpose {meta.purpose!r}: a batch reads a file uploaded with purpose "batch"',
            param="input_file_id",
            code="invalid_input_file",
        )
    now = utcnow()
    batch = Batch(
        id=uuid.uuid4(),
        project=caller.project,
        model=state.served.name,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        status=BatchStatus.IN_PROGRESS,
        input_file_id=meta.id,
        metadata_=body.metadata,
        created_at=now,
        in_progress_at=now,
        expires_at=now + timedelta(seconds=completion_window_seconds(body.completion_window)),
        output_expires_after_s=None if body.output_expires_after is None else body.output_expires_after.seconds,
    )
    limits = state.config.server
    try:
        # closing(): a refused line leaves the chunk reader mid-file; its session ends with the request.
        with closing(file_chunks.read_chunks(state.sessions, meta.id)) as chunks:
            lines = parse_batch_lines(chunks, limits.max_batch_lines, limits.max_body_mb * 2**20)
            jobs = jobs_for_lines(lines, body.endpoint, state.served, caller.project, caller.allowance)
            submit_batch(
                state.sessions,
                state.celery,
                batch,
                jobs,
                group_size=state.config.queue.group_size,
                admit=lambda num_queued: admit_batch_lines(state, caller, num_queued),
                idempotency=None if claim is None else claim.record(),
            )
    except QueueUnavailableError as exc:
        raise ApiError(
            503,
            f"{exc}; batch {batch.id} failed: retry when [queue] broker_url is reachable",
            code="queue_unavailable",
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        ) from None
    return _public(state, batch.id, caller)


@router.get("/{batch_id}", response_model=BatchPublic)
async def get_batch(batch_id: str, state: State, caller: Caller) -> BatchPublic:
    return await run_in_threadpool(_public, state, _parse_id(batch_id, caller), caller)


@router.get("", response_model=BatchPage)
async def list_batches(
    state: State,
    caller: Caller,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> BatchPage:
    """Newest first. Pass the previous page's `last_id` as `after` for the next page."""

    def page():
        cursor = None if after is None else _parse_id(after, caller, param="after")
        try:
            found = batch_queries.list_batches(state.sessions, _scope(caller), limit=limit, after=cursor)
        except LookupError as exc:
            raise ApiError(404, f"{exc}: pass the last_id of a page you received", param="after") from None
        counts = batch_queries.batch_counts(state.sessions, [b.id for b in found.rows])
        return [BatchPublic.of(b, counts[b.id]) for b in found.rows], found.has_more

    data, has_more = await run_in_threadpool(page)
    return BatchPage.of(data, has_more)


@router.post("/{batch_id}/cancel", response_model=BatchPublic)
async def cancel_batch(batch_id: str, state: State, caller: Caller) -> BatchPublic:
    """Queued requests never start; running ones are aborted (partial output kept). The batch is
    `cancelling` until none runs, then `cancelled` with output and error files."""

    def do_cancel():
        batch = _visible_or_404(state, _parse_id(batch_id, caller), caller)
        if batch.status not in CANCELLABLE:
            raise ApiError(
                409,
                f"batch {batch.id} is already {batch.status.value}: only a validating or "
                "in_progress batch can be cancelled",
                code="batch_not_cancellable",
            )
        cancel(state.sessions, batch.id)
        return _public(state, batch.id, caller)

    return await run_in_threadpool(do_cancel)


def _public(state: ApiState, batch_id: uuid.UUID, caller) -> BatchPublic:
    batch = _visible_or_404(state, batch_id, caller)
    return BatchPublic.of(batch, batch_queries.batch_counts(state.sessions, [batch.id])[batch.id])


def _visible_or_404(state: ApiState, batch_id: uuid.UUID, caller) -> Batch:
    batch = batch_queries.visible_batch(state.sessions, batch_id, _scope(caller))
    if batch is None:
        raise _not_found(str(batch_id), caller)
    return batch


def _parse_id(batch_id: str, caller, param: str = "batch_id") -> uuid.UUID:
    try:
        return uuid.UUID(batch_id)
    except ValueError:
        raise _not_found(batch_id, caller, param) from None


def _not_found(batch_id: str, caller, param: str = "batch_id") -> ApiError:
    where = "" if caller.is_admin else f" in project {caller.project!r}"
    return ApiError(
        404, f"no batch {batch_id!r}{where}: GET /v1/batches lists yours", param=param, code="batch_not_found"
    )


def _scope(caller) -> str | None:
    return None if caller.is_admin else caller.project
