"""`tokenloom db prune`: delete finished jobs, batches, files and stream keys past retention."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from datetime import timedelta


def add_prune_arguments(db) -> None:
    """The options of `tokenloom db prune` on the `db` subcommand's parser."""
    db.add_argument(
        "--older-than-days",
        type=float,
        metavar="N",
        help="prune: what finished more than N days ago (default: [database] retention_days)",
    )
    db.add_argument("--dry-run", action="store_true", help="prune: count what would go, delete nothing")


def cmd_prune(args, config) -> int:
    from tokenloom.store.database import make_session_factory, make_sql_engine
    from tokenloom.store.retention import count_prunable, prune

    days = args.older_than_days if args.older_than_days is not None else config.database.retention_days
    if not days or days <= 0:
        print(
            "error: no retention period: pass --older-than-days N, or set [database] retention_days "
            "(TOKENLOOM_DATABASE_RETENTION_DAYS) to a number of days > 0",
            file=sys.stderr,
        )
        return 2
    sessions = make_session_factory(make_sql_engine(config.database.url))
    older_than = timedelta(days=days)
    if args.dry_run:
        report = count_prunable(sessions, older_than)
        print(f"dry run: would delete what finished more than {days:g} days ago", file=sys.stderr)
    else:
        report = prune(sessions, _redis_or_none(config.queue.broker_url), older_than)
        print(f"deleted what finished more than {days:g} days ago", file=sys.stderr)
    print(json.dumps(asdict(report)))
    return 0


def _redis_or_none(broker_url: str):
    """The broker's client, or None when it is unreachable: stream keys then expire on their own
    (store/jobs/streams.py STREAM_TTL_S), so the database prune need not wait for Redis."""
    import redis

    client = redis.Redis.from_url(broker_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        print(
            f"warning: Redis at [queue] broker_url is unreachable ({exc}): stream keys are left to expire",
            file=sys.stderr,
        )
        return None
    return client
