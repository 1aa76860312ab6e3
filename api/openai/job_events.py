"""Follow one job's Redis Stream (store/jobs/streams.py) as an async iterator of its events.

Yields DeltaEvents (store/jobs/stream_events.py, `published_ms` filled in from the entry id) in order
and stops after the EndEvent. Two things it hides from the caller:

- restarts: a RestartEvent means the job was requeued (its worker shut down) and
  will be generated again from its first token. Tokens already yielded (counted per choice) are
  skipped in the new attempt, so a client never sees a token twice.
- a missing end: a job cancelled while queued, or a Redis that lost the stream, never gets an end
  entry. Whenever the stream stays idle for `idle_s`, the job's row (the truth) is checked; once
  it is terminal the stream is drained and iteration ends. If Redis is unreachable the iterator
  falls back to polling the row alone (no live tokens; the caller sends the result from the row).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tokenloom.store.jobs.stream_events import (
    DeltaEvent,
    EndEvent,
    RestartEvent,
    StreamEvent,
    UnknownStreamEvent,
    decode_event,
)
from tokenloom.store.jobs.streams import stream_key

log = logging.getLogger("tokenloom.api")


class JobEvents:
    def __init__(self, client: aioredis.Redis, job_id, is_terminal: Callable[[], Awaitable[bool]], idle_s: float = 1.0):
        self.client = client
        self.key = stream_key(job_id)
        self.is_terminal = is_terminal
        self.idle_ms = max(1, int(idle_s * 1000))
        self.sent_tokens: defaultdict[int, int] = defaultdict(int)  # per choice, over all attempts
        self.attempt_tokens: defaultdict[int, int] = defaultdict(int)  # per choice, this attempt
        self.restarted = False
        self.end: EndEvent | None = None  # the end event, once seen (None if the row ended without one)
        self.live = True  # False once Redis failed and only the row was polled

    def __aiter__(self) -> AsyncIterator[DeltaEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[DeltaEvent]:
        last_id = "0-0"
        while True:
            try:
                entries = await self._read(last_id, block=True)
                if not entries and await self.is_terminal():
                    entries = await self._read(last_id, block=False)  # written before the row ended
                    entries.append((None, None))  # the row ended: as if an end entry followed
            except RedisError as exc:
                log.warning("job stream %s unreadable (%s): waiting on the database row instead", self.key, exc)
                self.live = False
                await self._poll_row()
                return
            for entry_id, event in entries:
                last_id = entry_id or last_id
                if event is None or isinstance(event, EndEvent):
                    self.end = event
                    return
                if isinstance(event, RestartEvent):
                    self.restarted = True
                    self.attempt_tokens.clear()
                elif isinstance(event, DeltaEvent) and self._is_new(event):
                    yield event

    async def _read(self, last_id: str, block: bool) -> list[tuple[str | None, StreamEvent | None]]:
        reply = await self.client.xread({self.key: last_id}, count=512, block=self.idle_ms if block else None)
        entries = []
        for _key, items in reply or []:
            for entry_id, fields in items:
                entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    # The entry id is "<publish time in ms>-<seq>": the worker's clock, for ITL.
                    entries.append((entry_id, decode_event(fields[b"data"], int(entry_id.split("-", 1)[0]))))
                except UnknownStreamEvent as exc:  # a newer worker's event: skip it, keep relaying
                    log.warning("job stream %s: %s", self.key, exc)
        return entries

    def _is_new(self, event: DeltaEvent) -> bool:
        index = event.index
        num_tokens = len(event.token_ids)
        self.attempt_tokens[index] += num_tokens
        seen = self.attempt_tokens[index]
        if self.restarted and seen <= self.sent_tokens[index] and (num_tokens or seen < self.sent_tokens[index]):
            return False  # generated again after a restart: the client already has it
        self.sent_tokens[index] = max(self.sent_tokens[index], seen)
        return True

    async def _poll_row(self) -> None:
        while not await self.is_terminal():
            await asyncio.sleep(self.idle_ms / 1000)
