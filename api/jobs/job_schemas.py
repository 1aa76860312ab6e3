"""Bodies of the /v1/jobs endpoints: `JobRequest` in, `JobPublic` out (and a page of them)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from tokenloom.api.errors import ERROR_TYPES
from tokenloom.api.list_page import ListPage
from tokenloom.api.openai.openai_schemas import Messages, PositiveTokens, Prompt, SamplingFields
from tokenloom.engine import expand_prompt_logprobs
from tokenloom.store.jobs.work_class import PRIORITY_LIMIT
from tokenloom.store.models import Job

MAX_JOBS_PER_REQUEST = 10_000


class JobRequest(SamplingFields):
    """One job: `prompt` (completion) or `messages` (chat), plus sampling fields."""

    prompt: Prompt | None = None
    messages: Messages | None = None
    custom_id: Annotated[StrictStr, Field(min_length=1, max_length=512)] | None = None
    priority: Annotated[StrictInt, Field(ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)] = 0  # within its class
    max_completion_tokens: PositiveTokens | None = None
    logprobs: StrictBool | Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


JobsBody = JobRequest | Annotated[list[JobRequest], Field(min_length=1, max_length=MAX_JOBS_PER_REQUEST)]


class JobError(BaseModel):
    message: str
    type: str = "invalid_request_error"  # OpenAI's error type for the code's HTTP status
    code: str | None = None  # the row's JobErrorCode: invalid_request, engine_error, gave_up, ...

    @classmethod
    def of(cls, job: Job) -> "JobError":
        code = job.failure_code
        status = code.http_status if code is not None else 400
        return cls(
            message=job.error or "",
            type=ERROR_TYPES.get(status, "server_error"),
            code=None if code is None else code.value,
        )


class JobPublic(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: str
    model: str
    project: str
    endpoint: str
    batch_id: str | None
    custom_id: str | None
    work_class: str = Field(description="interactive | jobs | batch: the order it runs in (docs/priority.md)")
    priority: int = Field(description="its order within the class: lower runs first")
    created_at: int
    finished_at: int | None
    output_text: str | None
    output_token_ids: list[int] | None
    finish_reason: str | None
    choices: list[dict] | None = Field(
        description=(
            "Every completion: {index, text, token_ids, finish_reason, stop_reason, logprobs}. logprobs is null "
            "unless asked for, else one entry per token id: {token_id, token, bytes, logprob, top: [[id, logprob]], "
            "top_tokens: [{token, bytes}]} (top alternatives highest first; top_tokens spells top in order)."
        )
    )
    prompt_logprobs: list[dict] | None = Field(
        None,
        description=(
            "prompt_logprobs (or echo with logprobs) asked: one entry per prompt token, shaped as in choices' "
            "logprobs; the first token's logprob and top are null (nothing predicts it), as are those of positions "
            "never scored (a job cancelled while its prompt was being read). Only GET /v1/jobs/{id} returns them: "
            "null in list pages."
        ),
    )
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None
    tpot_s: float | None
    queue_s: float | None
    e2e_s: float | None
    attempts: int
    error: JobError | None

    @classmethod
    def of(cls, job: Job, *, with_prompt_logprobs: bool = True) -> "JobPublic":
        """`with_prompt_logprobs=False` for a row read without them (a list page): the field is null."""
        return cls(
            id=str(job.id),
            status=job.status.value,
            model=job.model,
            project=job.project,
            endpoint=job.endpoint,
            batch_id=None if job.batch_id is None else str(job.batch_id),
            custom_id=job.custom_id,
            work_class=job.work_class.value,
            priority=job.priority or 0,
            created_at=_unix(job.created_at),
            finished_at=_unix(job.finished_at),
            output_text=job.output_text,
            output_token_ids=job.output_token_ids,
            finish_reason=job.finish_reason,
            choices=job.choices,
            prompt_logprobs=expand_prompt_logprobs(job.prompt_logprobs) if with_prompt_logprobs else None,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            ttft_s=job.ttft_s,
            tpot_s=job.tpot_s,
            queue_s=job.queue_s,
            e2e_s=job.e2e_seconds,
            attempts=job.attempts or 0,
            error=None if job.error is None else JobError.of(job),
        )


class JobsCreated(BaseModel):
    object: Literal["list"] = "list"
    ids: list[str]
    data: list[JobPublic]


JobPage = ListPage[JobPublic]


def _unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())
