"""A job's Redis Stream -> OpenAI SSE, and waiting for a job's final row (non-streaming).

One `data:` chunk per delta (the worker publishes one per engine step, i.e. per token), then one
closing chunk per choice with its finish_reason, an optional usage chunk, and `data: [DONE]`.
Nothing here cancels the job: a client that disconnects stops the relay only, and the job's
result stays in its row (GET /v1/jobs/{id}).

While nothing arrives (the job waits in the queue, or a slow step) a `: keep-alive` SSE comment
goes out every KEEP_ALIVE_S seconds, so proxies and load balancers that cut idle connections
(often after 30-60 s) do not end the stream; SSE clients, the openai SDK included, skip comments.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from tokenloom.api.errors import error_body, failed_job_error
from tokenloom.api.metrics.stream_itl import ItlRecorder
from tokenloom.api.openai.job_events import JobEvents
from tokenloom.api.openai.sse_chunks import DONE, KEEP_ALIVE, ChunkLogprobs, ChunkShape, sse
from tokenloom.api.state import ApiState
from tokenloom.store.models import Job, JobStatus

# Seconds without an event before a keep-alive comment; read per stream (tests shorten it).
KEEP_ALIVE_S = 15.0


def _load(state: ApiState, job_id: uuid.UUID) -> Job:
    with state.sessions() as session:
        return session.get(Job, job_id)


def _status(state: ApiState, job_id: uuid.UUID) -> JobStatus | None:
    """The job's status alone: asked whenever a stream is idle, so never the whole row (its prompt logprobs)."""
    with state.sessions() as session:
        return session.scalar(select(Job.status).where(Job.id == job_id))


def job_events(state: ApiState, job_id: uuid.UUID) -> JobEvents:
    async def is_terminal() -> bool:
        status = await run_in_threadpool(_status, state, job_id)
        return status is None or status.is_terminal

    return JobEvents(state.redis, job_id, is_terminal)


async def wait_for_row(state: ApiState, job_id: uuid.UUID) -> Job:
    """The job's terminal row: woken by its stream's end event, with a row check whenever idle."""
    async for _ in job_events(state, job_id):
        pass
    return await run_in_threadpool(_load, state, job_id)


async def relay(state: ApiState, job: Job, shape: ChunkShape, include_usage: bool) -> AsyncIterator[bytes]:
    events = job_events(state, job.id)
    started: set[int] = set()  # choices that have sent their first chunk (it carries the role)
    itl = ItlRecorder(job.model)
    logprobs = ChunkLogprobs(shape.chat)
    async with aclosing(with_keep_alive(events, KEEP_ALIVE_S)) as paced:  # closed with the response
        async for event in paced:
            if event is None:
                yield KEEP_ALIVE
                continue
            itl.observe(event)
            index = event.index
            yield sse(
                shape.token(index, event.text, first=index not in started, logprobs=logprobs.of(index, event.logprobs))
            )
            started.add(index)
    row = await run_in_threadpool(_load, state, job.id)
    choices = row.choices or []
    if row.status is JobStatus.FAILED and not choices:
        failure = failed_job_error(row)
        yield sse(error_body(failure.status_code, failure.message, code=failure.code))
        yield DONE
        return
    if not events.live:  # Redis became unreachable: send whole texts of choices that relayed nothing yet
        for choice in (c for c in choices if c["index"] not in started):
            yield sse(
                shape.token(
                    choice["index"],
                    choice.get("text") or "",
                    first=choice["index"] not in started,
                    logprobs=logprobs.of(choice["index"], choice.get("logprobs")),
                )
            )
            started.add(choice["index"])
    for choice in choices or [{"index": 0, "finish_reason": _finish_reason(row)}]:
        index = choice.get("index", 0)
        yield sse(shape.finish(index, choice.get("finish_reason") or _finish_reason(row), first=index not in started))
    if include_usage:
        yield sse(shape.usage(row.prompt_tokens or 0, row.completion_tokens or 0))
    yield DONE


async def with_keep_alive(events: AsyncIterator[dict], interval_s: float) -> AsyncIterator[dict | None]:
    """`events`, with a None yielded each time `interval_s` passes without one.

    The pending read is waited on, never cancelled, by the timeout: cancelling an async
    generator mid-read would close it (and lose its place in the stream)."""
    iterator = aiter(events)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # the client went away mid-wait
            pending.cancel()


def _finish_reason(row: Job) -> str | None:
    return "abort" if row.status is JobStatus.CANCELLED else row.finish_reason
