"""Live token deltas on Redis Streams: one capped, expiring stream per job; Postgres stays the truth.

Each entry carries one JSON `data` field, an event of store/jobs/stream_events.py; the last entry of a
job is its EndEvent. A reader (the API's SSE relay) XREADs from the start, so a client that
connects late still sees every delta still in the stream.
"""

from __future__ import annotations

from typing import cast

import redis

from tokenloom.store.jobs.stream_events import EndEvent, StreamEvent, decode_event, encode_event

STREAM_PREFIX = "tokenloom:job:"
STREAM_TTL_S = 24 * 3600


def stream_key(job_id) -> str:
    return f"{STREAM_PREFIX}{job_id}"


class JobStreams:
    def __init__(self, client: redis.Redis, maxlen: int):
        self.client = client
        self.maxlen = maxlen

    def publish(self, job_id, event: StreamEvent) -> None:
        key = stream_key(job_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(key, {"data": encode_event(event)}, maxlen=self.maxlen, approximate=True)
        pipe.expire(key, STREAM_TTL_S)
        pipe.execute()

    def publish_many(self, events: list[tuple[object, StreamEvent]]) -> None:
        """Append many (job id, event) pairs in one round trip; each stream keeps its order."""
        pipe = self.client.pipeline(transaction=False)
        for job_id, event in events:
            pipe.xadd(stream_key(job_id), {"data": encode_event(event)}, maxlen=self.maxlen, approximate=True)
        for job_id in dict.fromkeys(job_id for job_id, _ in events):
            pipe.expire(stream_key(job_id), STREAM_TTL_S)
        pipe.execute()

    def close(self, job_id, status: str, finish_reason: str | None, error: str | None = None) -> None:
        self.publish(job_id, EndEvent(status, finish_reason, error))

    def read_all(self, job_id) -> list[StreamEvent]:
        # XRANGE on this (bytes) client gives a list of (id, fields); redis types it wider for other commands.
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(stream_key(job_id)))
        return [decode_event(fields[b"data"]) for _, fields in entries]
