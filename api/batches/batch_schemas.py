"""OpenAI's Batch object (openai.types.Batch), its create body and list page.

Ids are the row's UUID. `request_counts` and `usage` are summed from trigger-kept deltas of the
job rows (store/batches/batch_counters.py), so they move while the batch runs and a poll costs the
same at any size. `expired_at` stays null: batches are not expired yet (see docs/api.md).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from tokenloom.api.list_page import ListPage
from tokenloom.store.batches.batch_queries import BatchCounts
from tokenloom.store.models import Batch

COMPLETION_WINDOW_S = 24 * 3600  # "24h", the only window OpenAI accepts

MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    output_expires_after: dict | None = Field(None, description="accepted for SDK compatibility; ignored")


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
    expired_at: int | None = None
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
