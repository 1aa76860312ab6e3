"""The stream events' wire format (store/jobs/stream_events.py): what the worker writes, the API reads."""

from __future__ import annotations

import json

import pytest

from tokenloom.store.jobs.stream_events import (
    DeltaEvent,
    EndEvent,
    RestartEvent,
    UnknownStreamEvent,
    decode_event,
    encode_event,
)

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it


@pytest.mark.parametrize(
    "event",
    [
        DeltaEvent(0, "héllo", [5, 6]),
        DeltaEvent(2, "", [7], logprobs=[{"token": "a", "logprob": -0.5}]),
        RestartEvent(),
        EndEvent("failed", None, "engine error: boom"),
    ],
    ids=["delta", "delta-logprobs", "restart", "end"],
)
def test_every_event_reads_back_as_written(event):
    assert decode_event(encode_event(event)) == event


def test_the_wire_names_the_kind_and_never_carries_the_readers_clock():
    wire = json.loads(encode_event(DeltaEvent(1, "x", [3], published_ms=123)))
    assert wire == {"event": "delta", "index": 1, "text": "x", "token_ids": [3], "logprobs": None}


def test_the_reader_adds_the_publish_time():
    assert decode_event(encode_event(DeltaEvent(0, "x", [1])), published_ms=42).published_ms == 42


def test_fields_a_newer_writer_adds_are_ignored():
    assert decode_event('{"event": "end", "status": "succeeded", "finish_reason": "stop", "shard": 3}') == EndEvent(
        "succeeded", "stop"
    )


def test_an_unknown_kind_is_its_own_error():
    with pytest.raises(UnknownStreamEvent, match="'progress'"):
        decode_event('{"event": "progress"}')
