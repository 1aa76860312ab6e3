"""Inter-token latency (ITL) of streamed responses, observed by the API as it relays them.

ITL is not stored in the job rows (only TTFT and TPOT are), but every token event a worker
publishes carries its publish time in its Redis Stream entry id (milliseconds). The relay
(api/openai/stream_relay.py) records the gap between successive token events of each choice into
a process-wide histogram that /metrics exposes. It covers the streamed requests this API process
relayed (each replica reports its own; sum them), at millisecond resolution, and measures the
worker's publish times, so a slow client or network does not inflate it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from tokenloom.store.jobs.stream_events import DeltaEvent

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Not the default registry: /metrics builds its own registry per scrape and adds this histogram.
API_REGISTRY = CollectorRegistry(auto_describe=True)
STREAM_ITL = Histogram(
    "tokenloom_stream_itl_seconds",
    "Gap between successive token events of a streamed response (worker "
    "publish times), per choice; streamed requests relayed by this API process",
    ["model"],
    buckets=ITL_BUCKETS,
    registry=API_REGISTRY,
)


class ItlRecorder:
    """Feed it a response's token events in order; it observes each gap per choice."""

    def __init__(self, model: str):
        self.histogram = STREAM_ITL.labels(model)
        self.last_ms: dict[int, int] = {}

    def observe(self, event: DeltaEvent) -> None:
        published_ms = event.published_ms
        if published_ms is None:
            return
        index = event.index
        if index in self.last_ms:
            self.histogram.observe(max(0, published_ms - self.last_ms[index]) / 1000)
        self.last_ms[index] = published_ms
