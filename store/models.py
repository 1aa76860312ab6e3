"""The system of record: jobs, batches, files and API keys (SQLAlchemy 2.0, Postgres or SQLite).

One module shared by `worker/` and `api/`; Alembic migrations in `migrations/` must produce
exactly this schema (a test diffs them). Timestamps are timezone-aware UTC.
"""

from __future__ import annotations

import builtins
import enum
import uuid
from datetime import datetime, timezone

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tokenloom.store.jobs.work_class import DEFAULT_MIN_PRIORITY, WorkClass


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class JobStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_JOB_STATUSES


TERMINAL_JOB_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class JobErrorCode(str, enum.Enum):
    """Why a job ended without a result: the one field the API, streams and result lines read the
    kind of a failure from (never its message's wording)."""

    INVALID_REQUEST = "invalid_request"  # the request cannot run as sent: the client's to change
    ENGINE_ERROR = "engine_error"  # the engine failed while running it
    GAVE_UP = "gave_up"  # its worker died on every attempt (out of memory, killed)
    QUEUE_UNAVAILABLE = "queue_unavailable"  # Redis was unreachable when it was sent
    RESULT_UNSTORED = "result_unstored"  # the worker could not read or store its result
    CANCELLED = "cancelled"  # a client cancelled it
    BATCH_EXPIRED = "batch_expired"  # its batch's completion window ended before it ran (OpenAI's code)

    @property
    def http_status(self) -> int:
        """The HTTP status a request whose job ended so answers with, streamed or not.

        Only a request that cannot run is the client's error; every other failure happened after
        the API accepted the request, so it is the server's. A cancellation answers 409: the
        request was valid, another request ended it; so does a batch line its batch's expiry ended."""
        if self is JobErrorCode.INVALID_REQUEST:
            return 400
        if self in (JobErrorCode.CANCELLED, JobErrorCode.BATCH_EXPIRED):
            return 409
        return 500


class BatchStatus(str, enum.Enum):  # OpenAI Batch API statuses
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


def _enum(cls: type[enum.Enum], name: str, length: int = 16) -> Enum:
    # Stored as VARCHAR on every backend (no native enum type), so adding a state needs no ALTER TYPE.
    return Enum(cls, name=name, native_enum=False, values_callable=lambda e: [m.value for m in e], length=length)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    batch_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    project: Mapped[str] = mapped_column(String(64), default="default")
    custom_id: Mapped[str | None] = mapped_column(String(512))
    line_number: Mapped[int | None] = mapped_column(Integer)  # position in the batch / input file
    input_hash: Mapped[str | None] = mapped_column(String(64))  # sha256 of the input line (resumable runs)
    model: Mapped[str] = mapped_column(String(256))
    endpoint: Mapped[str] = mapped_column(String(32), default="/v1/completions")
    prompt: Mapped[str | None] = mapped_column(Text)
    prompt_token_ids: Mapped[list | None] = mapped_column(JSON)
    messages: Mapped[list | None] = mapped_column(JSON)
    params: Mapped[dict] = mapped_column(JSON, default=dict)  # SamplingParams fields the client set
    # completions' echo; no Python default: rows inserted against an older schema must not name it
    echo: Mapped[bool] = mapped_column(Boolean, server_default=false())
    priority: Mapped[int] = mapped_column(Integer, default=0)  # within its class: lower runs first (vLLM's)
    # Orders work at every stage: interactive, then jobs, then batch lines (store/jobs/work_class.py).
    # A server default only: rows inserted by code older than the column still get a class.
    work_class: Mapped[WorkClass] = mapped_column(
        _enum(WorkClass, "work_class", length=16), server_default=WorkClass.JOBS.value
    )
    status: Mapped[JobStatus] = mapped_column(_enum(JobStatus, "job_status"), default=JobStatus.QUEUED)
    output_text: Mapped[str | None] = mapped_column(Text)
    output_token_ids: Mapped[list | None] = mapped_column(JSON)
    choices: Mapped[list | None] = mapped_column(JSON)  # every completion when n > 1, with logprobs
    # Stored compactly (engine/outputs/compact_prompt_logprobs.py); rows written before that hold entry lists.
    prompt_logprobs: Mapped[dict | list | None] = mapped_column(JSON)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    error_code: Mapped[JobErrorCode | None] = mapped_column(_enum(JobErrorCode, "job_error_code", length=32))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(256))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    admitted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    first_token_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Derived at completion (ARCHITECTURE.md definitions), stored for cheap stats queries.
    queue_s: Mapped[float | None] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float | None] = mapped_column(Float)  # finished - arrival (the row's creation)
    # `tokenloom run` only: the exact result line it wrote, re-emitted verbatim when resumed.
    result_record: Mapped[dict | None] = mapped_column(JSON)

    @property
    def e2e_seconds(self) -> float | None:
        """Arrival to finish: what the worker measured (`e2e_s`), else the row's own timestamps
        (rows finished without an engine run, or before the column existed)."""
        if self.e2e_s is not None:
            return self.e2e_s
        if self.finished_at is None or self.created_at is None:
            return None
        return (self.finished_at - self.created_at).total_seconds()

    @property
    def failure_code(self) -> JobErrorCode | None:
        """Why the job ended without success; None while it runs or once it succeeded. A row ended
        by a worker older than the column counts as an engine error (a cancel as cancelled)."""
        if self.status in (JobStatus.FAILED, JobStatus.CANCELLED):
            return self.error_code or (
                JobErrorCode.CANCELLED if self.status is JobStatus.CANCELLED else JobErrorCode.ENGINE_ERROR
            )
        return None

    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_jobs_batch_custom_id"),
        Index("ix_jobs_status_created_at", "status", "created_at"),
        Index("ix_jobs_batch_id_status", "batch_id", "status"),
        Index("ix_jobs_batch_id_line_number", "batch_id", "line_number"),  # output files in line order
        Index("ix_jobs_project_created_at", "project", "created_at"),
        Index("ix_jobs_input_hash", "input_hash"),
        Index("ix_jobs_finished_at", "finished_at"),  # /v1/stats windows and retention
        Index("ix_jobs_created_at_id", "created_at", "id"),  # the admin's GET /v1/jobs pages
        # A model's queued batch lines, per project in arrival order: the fair claim (JobStore.claim_fair).
        Index("ix_jobs_fair_claim", "model", "work_class", "status", "project", "created_at"),
    )


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project: Mapped[str] = mapped_column(String(64), default="default")
    model: Mapped[str | None] = mapped_column(String(256))
    endpoint: Mapped[str] = mapped_column(String(32), default="/v1/chat/completions")
    completion_window: Mapped[str] = mapped_column(String(16), default="24h")
    status: Mapped[BatchStatus] = mapped_column(_enum(BatchStatus, "batch_status"), default=BatchStatus.VALIDATING)
    input_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    output_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[list | None] = mapped_column(JSON)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Its request counts are kept by triggers (store/batches/batch_counters.py): every batch made since
    # revision 0011; older ones are counted from their rows, so the migration needed no backfill.
    # `output_expires_after.seconds` of the create request: its output and error files expire then.
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)
    counted_by_triggers: Mapped[bool] = mapped_column(Boolean, server_default=true())
    # Set when the completion window ended unfinished (store/batches/batch_expiry.py); `expired` once final.
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # `tokenloom run` only: sha256(model + "\0" + absolute output path), finds the run to resume.
    run_key: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        Index("ix_batches_project_created_at", "project", "created_at"),
        Index("ix_batches_run_key", "run_key"),
        Index("ix_batches_created_at_id", "created_at", "id"),  # the admin's GET /v1/batches pages
        Index("ix_batches_status_expires_at", "status", "expires_at"),  # the expiry sweep
    )


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "file-<hex>", as OpenAI shapes it
    project: Mapped[str] = mapped_column(String(64), default="default")
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output | batch_error
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(Integer)
    # Null for files stored in FileChunk rows; set on rows upgraded from revision 0002 (stored whole).
    # builtins.bytes: in this class body `bytes` is the column above, not the type.
    content: Mapped[builtins.bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # A batch's output and error files expire when it asked (`output_expires_after`): from then on
    # they are 404s, and retention deletes their bytes (store/files/file_expiry.py).
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_files_project_created_at", "project", "created_at"),
        Index("ix_files_expires_at", "expires_at"),
        Index("ix_files_created_at_id", "created_at", "id"),  # the admin's GET /v1/files pages, retention
    )


class FileChunk(Base):
    """One piece of a file's bytes (store/files/file_chunks.py): uploads, downloads and batch outputs
    stream through these rows instead of holding a whole file (up to 200 MB) in memory."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0, 1, ... in file order
    data: Mapped[bytes] = mapped_column(LargeBinary)


# Aggregates of `jobs` for /metrics, /v1/stats and admission, kept by Postgres triggers as
# append-only deltas (store/jobs/job_aggregates.py says how and why). Empty on SQLite, which has no
# triggers and computes the figures from the rows.
job_count_deltas = Table(
    "job_count_deltas",
    Base.metadata,
    Column("model", String(256), nullable=False),
    Column("project", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    Column("num_jobs", BigInteger, nullable=False),  # rows in this state: goes down on delete
    Column("prompt_tokens", BigInteger, nullable=False),  # counters: never down on delete
    Column("completion_tokens", BigInteger, nullable=False),
)
job_histogram_deltas = Table(
    "job_histogram_deltas",
    Base.metadata,
    Column("model", String(256), nullable=False),
    Column("work_class", String(16), nullable=False, server_default=""),  # "" for deltas older than classes
    Column("metric", String(16), nullable=False),  # a timing column: ttft_s | tpot_s | queue_s | e2e_s
    Column("le", Float, nullable=False),  # the bucket's upper bound (values in (previous bound, le])
    Column("num_values", BigInteger, nullable=False),
    Column("value_sum", Float, nullable=False),
)
# A batch's request counts and token usage per status, kept by Postgres triggers the same way
# (revision 0011; store/batches/batch_counters.py reads them): a poll of a huge batch reads a few rows.
batch_count_deltas = Table(
    "batch_count_deltas",
    Base.metadata,
    Column("batch_id", Uuid, nullable=False),
    Column("status", String(16), nullable=False),
    Column("num_jobs", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),  # down on delete too: the sums of the lines there are
    Column("completion_tokens", BigInteger, nullable=False),
    Index("ix_batch_count_deltas_batch_id", "batch_id"),
)
job_histogram_bounds = Table(
    "job_histogram_bounds",
    Base.metadata,
    Column("metric", String(16), primary_key=True),
    Column("le", Float, primary_key=True),  # 'Infinity' included, so every value has a bucket
)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(128))
    key_prefix: Mapped[str] = mapped_column(String(16))  # shown in listings; the key itself is never stored
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Which classes of work the key may ask for (api/class_allowance.py, docs/priority.md); an admin
    # key may ask for anything. The server defaults hold every key created before the columns.
    # allow_priority_tier: `service_tier: "priority"` may lift a /v1/jobs request into the interactive class.
    allow_priority_tier: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # min_priority: the most important `priority` the key may set (lower runs first and preempts).
    min_priority: Mapped[int] = mapped_column(
        Integer, default=DEFAULT_MIN_PRIORITY, server_default=str(DEFAULT_MIN_PRIORITY)
    )

    __table_args__ = (Index("ix_api_keys_project", "project"),)


class IdempotencyKey(Base):
    """An `Idempotency-Key` a project sent with a create request, and what that request created
    (store/idempotency.py). The primary key makes two concurrent requests with one key race safely:
    the second INSERT fails, and that request replays the first one's rows."""

    __tablename__ = "idempotency_keys"

    project: Mapped[str] = mapped_column(String(64), primary_key=True)  # keys are scoped per tenant
    idempotency_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(32))  # the route that stored it, e.g. /v1/jobs
    request_hash: Mapped[str] = mapped_column(String(64))  # sha256 of the endpoint and canonical body
    job_ids: Mapped[list | None] = mapped_column(JSON)  # ids (str) of the jobs created, in request order
    batch_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (Index("ix_idempotency_keys_created_at", "created_at"),)  # retention deletes by age
