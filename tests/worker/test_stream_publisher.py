"""StreamPublisher against a real Redis: per-job order kept, many events per round trip, and a
Redis outage neither raises into the engine thread nor loses the events after it."""

from __future__ import annotations

import uuid

import pytest
import redis

from tokenloom.engine.outputs.outputs import CompletionOutput, RequestOutput
from tokenloom.store.jobs.stream_events import EndEvent
from tokenloom.store.jobs.streams import JobStreams
from tokenloom.worker.stream_publisher import StreamPublisher

REDIS_URL = "redis://127.0.0.1:6379/14"


@pytest.fixture
def streams():
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield JobStreams(client, maxlen=1000)
    client.flushdb()


def _output(job_id, token: int) -> RequestOutput:
    completion = CompletionOutput(
        index=0, text=f"t{token}", token_ids=[token], new_text=f"t{token}", new_token_ids=[token], finish_reason=None
    )
    return RequestOutput(request_id=str(job_id), prompt_token_ids=[1], outputs=[completion], finished=False)


def test_deltas_and_end_keep_their_order_per_job(streams):
    publisher = StreamPublisher(streams)
    jobs = [uuid.uuid4() for _ in range(3)]
    for token in range(20):
        for job_id in jobs:
            publisher.put_output(job_id, _output(job_id, token))
    for job_id in jobs:
        publisher.put_event(job_id, EndEvent("succeeded", "length"))
    assert publisher.flush()
    for job_id in jobs:
        events = streams.read_all(job_id)
        assert [e.token_ids for e in events[:-1]] == [[t] for t in range(20)]
        assert events[-1] == EndEvent("succeeded", "length")
        assert streams.client.ttl(f"tokenloom:job:{job_id}") > 0


def test_an_unreachable_redis_is_survived(streams):
    broken = JobStreams(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2), maxlen=10)
    publisher = StreamPublisher(broken)
    job_id = uuid.uuid4()
    publisher.put_output(job_id, _output(job_id, 1))  # must not raise on the caller's thread
    assert publisher.flush()
    publisher.streams = streams  # Redis is back
    publisher.put_event(job_id, EndEvent("succeeded", "stop"))
    assert publisher.flush()
    assert isinstance(streams.read_all(job_id)[-1], EndEvent)
