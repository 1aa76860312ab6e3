"""Following a job's Redis Stream (real Redis): dedup across restarts, and a job that ends without
an end event (cancelled while queued) still ends the relay."""

from __future__ import annotations

import asyncio
import json
import uuid

import redis
import redis.asyncio as aioredis

from tokenloom.api.openai.job_events import JobEvents
from tokenloom.store.jobs.streams import stream_key

REDIS_URL = "redis://127.0.0.1:6379/0"


def _publish(job_id, events: list[dict]) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    for event in events:
        client.xadd(stream_key(job_id), {"data": json.dumps(event)})
    client.expire(stream_key(job_id), 60)


def _collect(job_id, terminal: bool = False) -> tuple[list[dict], JobEvents]:
    async def run():
        client = aioredis.Redis.from_url(REDIS_URL)

        async def is_terminal() -> bool:
            return terminal

        events = JobEvents(client, job_id, is_terminal, idle_s=0.05)
        seen = [event async for event in events]
        await client.aclose()
        return seen, events

    return asyncio.run(asyncio.wait_for(run(), timeout=10))


def delta(text: str, index: int = 0) -> dict:
    return {"event": "delta", "index": index, "text": text, "token_ids": [len(text)]}


def test_a_restarted_job_relays_each_token_once():
    job_id = uuid.uuid4()
    _publish(
        job_id,
        [
            delta("a"),
            delta("b"),
            {"event": "restart"},
            delta("a"),
            delta("b"),
            delta("c"),
            {"event": "end", "status": "succeeded", "finish_reason": "length", "error": None},
        ],
    )
    seen, events = _collect(job_id)
    assert [e.text for e in seen] == ["a", "b", "c"]
    assert events.end.finish_reason == "length"
    assert all(e.published_ms is not None for e in seen)  # the worker's clock, from each entry id


def test_choices_are_counted_separately():
    job_id = uuid.uuid4()
    _publish(
        job_id,
        [
            delta("a", 0),
            delta("x", 1),
            {"event": "restart"},
            delta("a", 0),
            delta("b", 0),
            delta("x", 1),
            {"event": "end", "status": "succeeded", "finish_reason": "stop", "error": None},
        ],
    )
    seen, _ = _collect(job_id)
    assert [(e.index, e.text) for e in seen] == [(0, "a"), (1, "x"), (0, "b")]


def test_a_job_that_ends_without_an_end_event_stops_once_its_row_is_terminal():
    job_id = uuid.uuid4()
    _publish(job_id, [delta("a")])
    seen, events = _collect(job_id, terminal=True)
    assert [e.text for e in seen] == ["a"] and events.end is None


def test_an_event_of_an_unknown_kind_is_skipped():
    """A newer worker's event kind must not break an older API's relay."""
    job_id = uuid.uuid4()
    _publish(
        job_id,
        [
            delta("a"),
            {"event": "progress", "percent": 50},
            delta("b"),
            {"event": "end", "status": "succeeded", "finish_reason": "stop", "error": None},
        ],
    )
    seen, events = _collect(job_id)
    assert [e.text for e in seen] == ["a", "b"] and events.end.status == "succeeded"
