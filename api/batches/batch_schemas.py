"""OpenAI's Batch object (openai.types.Batch), its create body and list page.

Ids are the row's UUID. `request_counts` and `usage` are summed from trigger-kept deltas of the
job rows (store/batches/batch_counters.py), so they move while the batch runs and a poll costs the
same at any size. A batch whose `completion_window` ends unfinished expires (store/batches/batch_expiry.py).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from tokenloom.api.list_page import ListPage
from tokenloom.store.batches.batch_queries import BatchCounts
from tokenloom.store.files.file_expiry import MAX_SECONDS, MIN_SECONDS
from tokenloom.store.models import Batch

MAX_COMPLETION_WINDOW_S = 24 * 3600  # "24h", the only window OpenAI accepts, and the longest here
# A shorter window (an extension: "90s", "30m", "2h") lets a deadline come sooner, and a test end in seconds.
COMPLETION_WINDOW_PATTERN = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def completion_window_seconds(window: str) -> int:
    """Seconds of a window such as "24h", "30m" or "90s" (already validated by BatchCreate)."""
    match = COMPLETION_WINDOW_PATTERN.match(window)
    if match is None:
        raise ValueError(f"not a completion window: {window!r}")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]


class OutputExpiresAfter(BaseModel):
    """OpenAI's `output_expires_after`: the batch's output and error files expire this long after they are written."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: Annotated[StrictInt, Field(ge=MIN_SECONDS, le=MAX_SECONDS)]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Annotated[
        StrictStr,
        Field(
            description='"24h" (OpenAI\'s only window), or a shorter one as an extension: "<n>s", "<n>m" or "<n>h"',
            examples=["24h"],
        ),
    ]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    output_expires_after: OutputExpiresAfter | None = None

    @field_validator("completion_window")
    @classmethod
    def _window(cls, window: str) -> str:
        if (
            COMPLETION_WINDOW_PATTERN.match(window) is None
            or completion_window_seconds(window) > MAX_COMPLETION_WINDOW_S
        ):
            raise ValueError(
                f'completion_window {window!r}: use "24h", or a shorter window written as a number and a unit '
                '(s, m or h), e.g. "30m" or "90s"'
            )
        return window


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class BatchPublic(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str | None  # null for batches submitted with `tokenloom submit`
    completion_window: str
    status: Literal[
        "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, batch: Batch, counts: BatchCounts) -> "BatchPublic":
        return cls(
            id=str(batch.id),
            endpoint=batch.endpoint,
            model=batch.model,
            errors=BatchErrors(data=[BatchError(**e) for e in batch.errors]) if batch.errors else None,
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            status=batch.status.value,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            created_at=_unix(batch.created_at),
            in_progress_at=_unix(batch.in_progress_at),
            expires_at=_unix(batch.expires_at),
            finalizing_at=_unix(batch.finalizing_at),
            completed_at=_unix(batch.completed_at),
            failed_at=_unix(batch.failed_at),
            expired_at=_unix(batch.expired_at),
            cancelling_at=_unix(batch.cancelling_at),
            cancelled_at=_unix(batch.cancelled_at),
            request_counts=RequestCounts(total=counts.total, completed=counts.completed, failed=counts.failed),
            usage=BatchUsage(
                input_tokens=counts.input_tokens,
                output_tokens=counts.output_tokens,
                total_tokens=counts.input_tokens + counts.output_tokens,
            ),
            metadata=batch.metadata_,
        )


BatchPage = ListPage[BatchPublic]


def _unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())
