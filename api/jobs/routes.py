"""/v1/jobs: submit prompts as asynchronous jobs, read them back, list, cancel."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from tokenloom.api.admission import admit
from tokenloom.api.deps import Caller, State
from tokenloom.api.errors import ApiError
from tokenloom.api.idempotency import (
    REPLAYED_HEADERS,
    IdempotencyKeyHeader,
    create_once,
    idempotency_claim,
    replay_not_found,
)
from tokenloom.api.ignored_fields import ignored_field_headers
from tokenloom.api.job_enqueue import enqueue
from tokenloom.api.job_request import build_job
from tokenloom.api.jobs.job_schemas import JobPage, JobPublic, JobsBody, JobsCreated
from tokenloom.store import idempotency
from tokenloom.store.jobs import job_queries
from tokenloom.store.jobs.job_service import cancel
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", status_code=202, response_model=JobsCreated)
async def create_jobs(
    body: JobsBody, state: State, caller: Caller, response: Response, idempotency_key: IdempotencyKeyHeader = None
) -> JobsCreated:
    """One job (`prompt` or `messages`) or a list of them; all are validated before any is queued.
    With an `Idempotency-Key`, a retry returns the jobs the first request created (one key per request)."""
    items = body if isinstance(body, list) else [body]
    dumped = [item.model_dump(mode="json", exclude_none=True) for item in items]
    claim = idempotency_claim(idempotency_key, caller, "/v1/jobs", dumped if isinstance(body, list) else dumped[0])

    def submit():
        jobs = [
            build_job(
                item.model_dump(exclude_none=True),
                state.served,
                caller,
                WorkClass.JOBS,
                custom_id=item.custom_id,
                where=f"item {i}: " if isinstance(body, list) else "",
            )
            for i, item in enumerate(items)
        ]
        admit(state, caller, jobs)
        return enqueue(state, jobs, claim)

    def replay(previous):
        jobs = idempotency.jobs_in_order(state.sessions, previous.job_ids)
        if len(jobs) != len(previous.job_ids):
            raise replay_not_found(claim, "jobs")
        return jobs

    jobs, replayed = await run_in_threadpool(create_once, state.sessions, claim, submit, replay)
    if replayed:
        response.headers.update(REPLAYED_HEADERS)
    for item in items:  # the first item carrying unknown fields names them; one header per response
        if ignored := ignored_field_headers(item, "/v1/jobs"):
            response.headers.update(ignored)
            break
    return JobsCreated(ids=[str(j.id) for j in jobs], data=[JobPublic.of(j) for j in jobs])


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(job_id: uuid.UUID, state: State, caller: Caller) -> Response:
    """The job, its prompt logprobs included (read and encoded on a thread: they can be hundreds of MB)."""
    return await run_in_threadpool(lambda: json_response(JobPublic.of(visible_job_or_404(state, caller, job_id))))


@router.get("", response_model=JobPage)
async def list_jobs(
    state: State,
    caller: Caller,
    status: JobStatus | None = None,
    batch_id: uuid.UUID | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after: uuid.UUID | None = None,
) -> Response:
    """Newest first. Pass the previous page's `last_id` as `after` for the next page. A page never reads
    the jobs' prompts or prompt logprobs (`prompt_logprobs` is null here: GET /v1/jobs/{id} has them)."""
    project = None if caller.is_admin else caller.project

    def page_response() -> Response:
        try:
            page = job_queries.list_jobs(
                state.sessions, project, status=status, batch_id=batch_id, limit=limit, after=after
            )
        except LookupError as exc:
            raise ApiError(404, f"{exc}: pass the last_id of a page you received", param="after") from None
        data = [JobPublic.of(j, with_prompt_logprobs=False) for j in page.jobs]
        return json_response(JobPage.of(data, page.has_more))

    return await run_in_threadpool(page_response)


@router.post("/{job_id}/cancel", response_model=JobPublic)
async def cancel_job(job_id: uuid.UUID, state: State, caller: Caller) -> Response:
    """Queued: cancelled at once. Running: `cancelling` until its worker aborts it (partial output kept)."""

    def do_cancel() -> Response:
        visible_job_or_404(state, caller, job_id)
        cancel(state.sessions, job_id)
        return json_response(JobPublic.of(visible_job_or_404(state, caller, job_id)))

    return await run_in_threadpool(do_cancel)


def json_response(body: BaseModel) -> Response:
    """The response_model's JSON, encoded by the caller's thread (never the event loop's)."""
    return Response(body.model_dump_json(), media_type="application/json")


def visible_job_or_404(state, caller, job_id: uuid.UUID):
    job = job_queries.visible_job(state.sessions, job_id, None if caller.is_admin else caller.project)
    if job is None:
        raise ApiError(
            404,
            f"no job {job_id}" + ("" if caller.is_admin else f" in project {caller.project!r}"),
            param="job_id",
            code="job_not_found",
        )
    return job
