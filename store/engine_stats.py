"""A worker's engine figures, published to Redis for the API's /metrics.

The engine lives in the worker process; the API cannot see it. Each worker's heartbeat writes a
snapshot (current batch, KV pool use, the cumulative EngineCounters) to one Redis hash per worker
with a TTL of a few heartbeats, so a dead worker's figures vanish by themselves and the API
needs no registry of workers: it reads every `tokenloom:engine:*` hash it finds.

The snapshot is read without a lock from another thread than the engine's: every field is one
int read (atomic under the GIL), so a snapshot may mix two adjacent steps, which is fine for
monitoring.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import cast

import redis
from redis.typing import EncodableT, FieldT

ENGINE_STATS_PREFIX = "tokenloom:engine:"
DEFAULT_TTL_S = 60.0


def engine_stats_key(worker_id: str) -> str:
    return f"{ENGINE_STATS_PREFIX}{worker_id}"


def engine_snapshot(engine) -> dict[str, str | int | float]:
    counters = engine.counters
    pool = engine.kv_manager.pool
    return {
        "model": engine.model_name,
        "running_seqs": len(engine.scheduler.running),  # the batch the next step runs
        "waiting_seqs": len(engine.scheduler.waiting),
        "kv_blocks_used": pool.num_used_blocks,
        "kv_blocks_total": pool.num_blocks,
        "kv_block_size": engine.kv_manager.block_size,
        "steps": counters.num_steps,
        "scheduled_seqs": counters.num_scheduled_seqs,  # / steps = mean batch size
        "max_batch_seqs": counters.max_batch_seqs,
        "prefill_tokens": counters.num_prefill_tokens,
        "decode_tokens": counters.num_decode_tokens,
        "generated_tokens": counters.num_generated_tokens,
        "finished_requests": counters.num_finished_requests,
        "preemptions": counters.num_preemptions,
        "swap_outs": getattr(counters, "num_swap_outs", 0),  # preemptions that kept their KV in host memory
        "prefix_cache_query_tokens": counters.prefix_cache_queries,
        "prefix_cache_hit_tokens": counters.prefix_cache_hits,
        "updated_at": time.time(),
    }


def publish_engine_stats(redis_client: redis.Redis, worker_id: str, engine, ttl_s: float = DEFAULT_TTL_S) -> None:
    """Write the engine's snapshot to `tokenloom:engine:<worker_id>`, expiring after `ttl_s`."""
    key = engine_stats_key(worker_id)
    pipe = redis_client.pipeline(transaction=False)
    # Mapping is invariant in its key type, so str keys do not match redis' FieldT union as typed.
    pipe.hset(key, mapping=cast(Mapping[FieldT, EncodableT], engine_snapshot(engine)))
    pipe.expire(key, max(1, int(ttl_s)))
    pipe.execute()


def heartbeat_ages(redis_client: redis.Redis, host: str) -> dict[str, float]:
    """Worker id -> seconds since it last published, for the live workers of `host` (a worker id
    is <host>:<pid>): what a container healthcheck asks about the worker in its own container."""
    keys = list(redis_client.scan_iter(match=f"{engine_stats_key(host)}:*", count=100))
    now = time.time()
    ages = {}
    for key, updated_at in zip(keys, [redis_client.hget(key, "updated_at") for key in keys]):
        if updated_at is not None:  # expired between SCAN and HGET
            ages[key.decode().removeprefix(ENGINE_STATS_PREFIX)] = max(0.0, now - float(updated_at))
    return ages
