"""POST /v1/chat/completions and /v1/completions: OpenAI's shapes, served through the job queue.

Each prompt becomes one job row (so it is measured, listed and cancellable like any other): a
completions request with a list of prompts makes one job per prompt and answers with their choices
in prompt order. `stream: true` (one prompt) relays the job's Redis Stream as SSE, otherwise the
response waits for the rows. The job ids are returned in the `X-Job-Id` header (comma-separated).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenloom.api.admission import admit
from tokenloom.api.auth import Principal
from tokenloom.api.deps import Caller, State
from tokenloom.api.errors import ApiError, failed_job_error
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
from tokenloom.api.openai.openai_schemas import ChatCompletionRequest, CompletionRequest, StreamingFields
from tokenloom.api.openai.sse_chunks import ChunkShape
from tokenloom.api.openai.stream_relay import relay, wait_for_row
from tokenloom.api.state import ApiState
from tokenloom.engine import SamplingParams
from tokenloom.openai_protocol.openai_response import merged_completion_body
from tokenloom.openai_protocol.scoring_limit import PromptLogprobsTooLargeError, check_prompt_logprob_entries
from tokenloom.store.batches.batch_finalizer import completion_body
from tokenloom.store.idempotency import IdempotencyClaim, PreviousRequest, jobs_in_order
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus

router = APIRouter(prefix="/v1", tags=["openai"])

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, state: State, caller: Caller, idempotency_key: IdempotencyKeyHeader = None
):
    """Chat: `messages` through the model's chat template ([model] chat_template if it has none)."""
    return await _complete(body, state, caller, chat=True, idempotency_key=idempotency_key)


@router.post("/completions")
async def completions(
    body: CompletionRequest, state: State, caller: Caller, idempotency_key: IdempotencyKeyHeader = None
):
    """Text completion of `prompt`: a string, token ids, or a list of either (choices in prompt order,
    `index` = prompt number x n + choice number). `echo` and `max_tokens: 0` score prompts."""
    return await _complete(body, state, caller, chat=False, idempotency_key=idempotency_key)


async def _complete(
    body: StreamingFields, state: ApiState, caller: Principal, chat: bool, idempotency_key: str | None = None
):
    fields = body.model_dump(exclude_none=True)
    prompts = body.prompts() if isinstance(body, CompletionRequest) else [None]
    _check_prompts(prompts, body)
    # A replay (same key and body) answers like the first request: it waits for or streams the same jobs.
    claim = idempotency_claim(
        idempotency_key,
        caller,
        "/v1/chat/completions" if chat else "/v1/completions",
        body.model_dump(mode="json", exclude_none=True),
    )
    jobs, replayed = await run_in_threadpool(
        create_once,
        state.sessions,
        claim,
        lambda: _submit(state, caller, fields, prompts, claim),
        lambda previous: _replayed_jobs(state, claim, previous),
    )
    headers = {
        "X-Job-Id": ",".join(str(job.id) for job in jobs),
        **(REPLAYED_HEADERS if replayed else {}),
        **ignored_field_headers(body, "/v1/chat/completions" if chat else "/v1/completions"),
    }
    if body.stream:
        job = jobs[0]
        shape = ChunkShape.for_job(chat, job.id, int(job.created_at.timestamp()), job.model)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            relay(state, job, shape, include_usage), media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
        )
    rows = await asyncio.gather(*(wait_for_row(state, job.id) for job in jobs))
    for row in rows:
        if row.status is JobStatus.FAILED and not row.choices:
            raise failed_job_error(row)
    # Built and encoded on a thread: a body with prompt logprobs can be hundreds of MB (scoring_limit.py).
    return await run_in_threadpool(_response, rows, headers)


def _response(rows: list[Job], headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(merged_completion_body([completion_body(row) for row in rows]), headers=headers)


def _check_prompts(prompts: list, body: StreamingFields) -> None:
    if not prompts:
        raise ApiError(400, "prompt is an empty list: send a prompt, or a list of at least one", param="prompt")
    if body.stream and len(prompts) > 1:
        raise ApiError(
            400,
            f"stream: true takes one prompt, got {len(prompts)}: send one request per prompt, "
            "or drop stream to get every prompt's choices in one response",
            param="stream",
        )
    if body.stream and getattr(body, "echo", None):
        raise ApiError(
            400,
            "echo is not supported with stream: true: drop stream (the prompt and its logprobs "
            "come back in one response)",
            param="echo",
        )


def _submit(
    state: ApiState, caller: Principal, fields: dict, prompts: list, claim: IdempotencyClaim | None = None
) -> list[Job]:
    if prompts == [None]:  # chat: the messages are the prompt
        jobs = [build_job(fields, state.served, caller, WorkClass.INTERACTIVE)]
    else:
        jobs = [
            build_job(
                {**fields, "prompt": prompt},
                state.served,
                caller,
                WorkClass.INTERACTIVE,
                where=f"prompt[{i}]: " if len(prompts) > 1 else "",
            )
            for i, prompt in enumerate(prompts)
        ]
        _check_prompt_logprobs_total(state, jobs, echo=bool(fields.get("echo")))
    admit(state, caller, jobs)
    return enqueue(state, jobs, claim)


def _check_prompt_logprobs_total(state: ApiState, jobs: list[Job], echo: bool) -> None:
    """One response holds every prompt's choices: their prompt logprobs count against one limit together
    (each prompt was checked on its own by build_job)."""
    if len(jobs) < 2:
        return
    params = SamplingParams.merged(jobs[0].params or {})  # every prompt of a request has the same fields
    num_tokens = sum(len(job.prompt_token_ids or ()) for job in jobs)
    try:
        check_prompt_logprob_entries(
            params, num_tokens, state.served.max_prompt_logprob_entries, echo=echo, num_prompts=len(jobs)
        )
    except PromptLogprobsTooLargeError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _replayed_jobs(state: ApiState, claim: IdempotencyClaim, previous: PreviousRequest) -> list[Job]:
    jobs = jobs_in_order(state.sessions, previous.job_ids)
    if not jobs:
        raise replay_not_found(claim, "job")
    return jobs
