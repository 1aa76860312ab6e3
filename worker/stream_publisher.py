"""One thread that writes every job's stream events to Redis, a step's worth per round trip.

The engine thread hands each step's deltas over with `put` (a queue append: it must never wait on
I/O); this thread drains whatever has accumulated and sends it as one Redis pipeline. With a
thread and a round trip per job per token instead, 64 running jobs meant 64 wake-ups and 64
round trips per step, stealing the CPU from the engine's GEMMs on small machines. Events of one
job keep their order (one queue, one writer). Redis failures are logged once per outage: the
streams are a convenience, the job rows are the truth.

The events are store/jobs/stream_events.py's; a DeltaEvent's logprobs are spelled here (one stored
entry per token id, engine/outputs/logprob_tokens.py) rather than on the engine thread, and only
for requests that asked for them.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from tokenloom.engine import RequestOutput, TokenLogprobs, TokenSpeller
from tokenloom.store.jobs.stream_events import DeltaEvent, StreamEvent
from tokenloom.store.jobs.streams import JobStreams

log = logging.getLogger("tokenloom.worker")

MAX_EVENTS_PER_ROUND = 4096


@dataclass(frozen=True, slots=True)
class _Delta:
    """One choice's new tokens, copied on the engine thread (the engine keeps appending to its lists)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None


class StreamPublisher:
    def __init__(self, streams: JobStreams, speller: TokenSpeller | None = None):
        """`speller`: spells the logprobs of requests that asked for them; without one none are sent."""
        self.streams = streams
        self.speller = speller
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failing = False
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._run, name="tokenloom-streams", daemon=True).start()

    def put_output(self, job_id, output: RequestOutput) -> None:
        """Queue the new tokens of an engine output (called on the engine thread)."""
        deltas = [
            _Delta(
                c.index,
                c.new_text,
                list(c.new_token_ids),
                None if c.logprobs is None or not c.new_token_ids else c.logprobs[-len(c.new_token_ids) :],
            )
            for c in output.outputs
            if c.new_token_ids or c.new_text
        ]
        self._idle.clear()
        self._queue.put((job_id, deltas))

    def put_event(self, job_id, event: StreamEvent) -> None:
        """Queue a control event (end, restart) after the job's earlier deltas."""
        self._idle.clear()
        self._queue.put((job_id, event))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far was sent (or failed); for tests and shutdown."""
        return self._idle.wait(timeout_s)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_EVENTS_PER_ROUND:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                # Inside the try: whatever goes wrong, this thread must live on for the next events.
                events = [(job_id, event) for job_id, item in batch for event in self._events(item)]
                if events:
                    self.streams.publish_many(events)
                if self._failing:
                    self._failing = False
                    log.info("stream publishing works again")
            except Exception as exc:
                if not self._failing:
                    self._failing = True
                    log.warning(
                        "stream publish failed (%s); job rows are unaffected, retrying with the next events", exc
                    )
            if self._queue.empty():
                self._idle.set()

    def _events(self, item: StreamEvent | list[_Delta]) -> list[StreamEvent]:
        if not isinstance(item, list):
            return [item]
        speller = self.speller
        return [
            DeltaEvent(
                d.index,
                d.text,
                d.token_ids,
                None if speller is None or d.logprobs is None else speller.entries(d.logprobs),
            )
            for d in item
        ]
