"""The events on a job's Redis Stream, as types: what the worker publishes and the API relays.

Each stream entry holds one JSON `data` field, `{"event": KIND, ...fields}`:

- `delta`: new tokens of one choice (`index`), their text and, when asked for, their logprobs
  (one stored entry per token id, engine/outputs/logprob_tokens.py);
- `restart`: the job was handed back and runs again from the start; readers drop what they saw;
- `end`: the job's row is terminal (`status`, `finish_reason`, `error`); always the last entry.

`published_ms` is not on the wire: a reader fills it in from the entry id ("<ms>-<seq>", the
worker's clock when it wrote the entry), for inter-token latency.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class DeltaEvent:
    KIND: ClassVar[str] = "delta"
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None = None
    published_ms: int | None = None  # set by the reader, never sent


@dataclass(frozen=True, slots=True)
class RestartEvent:
    KIND: ClassVar[str] = "restart"


@dataclass(frozen=True, slots=True)
class EndEvent:
    KIND: ClassVar[str] = "end"
    status: str
    finish_reason: str | None
    error: str | None = None


StreamEvent = DeltaEvent | RestartEvent | EndEvent
_KINDS: dict[str, type] = {cls.KIND: cls for cls in (DeltaEvent, RestartEvent, EndEvent)}


class UnknownStreamEvent(ValueError):
    """An entry this version cannot read (a newer worker's kind): readers skip it."""


def encode_event(event: StreamEvent) -> str:
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name != "published_ms"}
    return json.dumps({"event": event.KIND, **fields})


def decode_event(data: bytes | str, published_ms: int | None = None) -> StreamEvent:
    """One entry's `data` field; `published_ms` from its entry id where the reader has one."""
    fields = json.loads(data)
    kind = fields.pop("event", None)
    cls = _KINDS.get(kind)
    if cls is None:
        raise UnknownStreamEvent(f"unknown stream event {kind!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    event = cls(**{name: value for name, value in fields.items() if name in known})
    if isinstance(event, DeltaEvent) and published_ms is not None:
        event = dataclasses.replace(event, published_ms=published_ms)
    return event
