"""POST /v1/chat/completions and /v1/completions: OpenAI's shapes, served through the job queue.

Each request becomes one job row (so it is measured, listed and cancellable like any other);
`stream: true` relays the job's Redis Stream as SSE, otherwise the response waits for the row.
The job id is returned in the `X-Job-Id` header either way.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenloom.api.admission import admit
from tokenloom.api.auth import Principal
from tokenloom.api.deps import Caller, State
from tokenloom.api.errors import failed_job_error
from tokenloom.api.ignored_fields import ignored_field_headers
from tokenloom.api.idempotency import (
    REPLAYED_HEADERS, IdempotencyKeyHeader, create_once, idempotency_claim, replay_not_found,
)
from tokenloom.api.job_enqueue import enqueue
from tokenloom.api.job_request import build_job
from tokenloom.api.openai_schemas import ChatCompletionRequest, CompletionRequest, StreamingFields
from tokenloom.api.sse_chunks import ChunkShape
from tokenloom.api.state import ApiState
from tokenloom.api.stream_relay import relay, wait_for_row
from tokenloom.store.batch_finalizer import completion_body
from tokenloom.store.idempotency import IdempotencyClaim, PreviousRequest, jobs_in_order
from tokenloom.store.models import Job, JobStatus

router = APIRouter(prefix="/v1", tags=["openai"])

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, state: State, caller: Caller,
                           idempotency_key: IdempotencyKeyHeader = None):
    """Chat: `messages` through the model's chat template ([model] chat_template if it has none)."""
    return await _complete(body, state, caller, chat=True, idempotency_key=idempotency_key)


@router.post("/completions")
async def completions(body: CompletionRequest, state: State, caller: Caller,
                      idempotency_key: IdempotencyKeyHeader = None):
    """Text completion of one `prompt` (text or token ids)."""
    return await _complete(body, state, caller, chat=False, idempotency_key=idempotency_key)


async def _complete(body: StreamingFields, state: ApiState, caller: Principal, chat: bool,
                    idempotency_key: str | None = None):
    fields = body.model_dump(exclude_none=True)
    # A replay (same key and body) answers like the first request: it waits for or streams the same job.
    claim = idempotency_claim(idempotency_key, caller, "/v1/chat/completions" if chat else "/v1/completions",
                              body.model_dump(mode="json", exclude_none=True))
    job, replayed = await run_in_threadpool(create_once, state.sessions, claim,
                                            lambda: _submit(state, caller, fields, claim),
                                            lambda previous: _replayed_job(state, claim, previous))
    headers = {"X-Job-Id": str(job.id), **(REPLAYED_HEADERS if replayed else {}),
               **ignored_field_headers(body, "/v1/chat/completions" if chat else "/v1/completions")}
    if body.stream:
        shape = ChunkShape.for_job(chat, job.id, int(job.created_at.timestamp()), job.model)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(relay(state, job, shape, include_usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    row = await wait_for_row(state, job.id)
    if row.status is JobStatus.FAILED and not row.choices:
        raise failed_job_error(row)
    return JSONResponse(completion_body(row), headers=headers)


def _submit(state: ApiState, caller: Principal, fields: dict, claim: IdempotencyClaim | None = None) -> Job:
    job = build_job(fields, state.served, caller.project)
    admit(state, caller, 1)
    return enqueue(state, [job], claim)[0]


def _replayed_job(state: ApiState, claim: IdempotencyClaim, previous: PreviousRequest) -> Job:
    jobs = jobs_in_order(state.sessions, previous.job_ids)
    if not jobs:
        raise replay_not_found(claim, "job")
    return jobs[0]

