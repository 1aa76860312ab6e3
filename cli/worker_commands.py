"""`tokenloom db | worker | submit | status | cancel`: the job-queue commands (heavy imports stay lazy)."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
import uuid
from pathlib import Path

from tokenloom.cli.config_args import add_config_argument, add_engine_arguments, add_model_arguments, load_cli_config
from tokenloom.cli.db_commands import add_prune_arguments, cmd_prune
from tokenloom.cli.error_handler import CliError

log = logging.getLogger("tokenloom.cli")

EPILOG = """\
examples:
  tokenloom db upgrade                       # create/upgrade the schema in [database] url
  tokenloom db prune --older-than-days 30    # delete finished jobs, batches and files older than that
  tokenloom worker --config config.toml      # one Celery worker hosting one engine
  tokenloom worker --model Qwen/Qwen3-0.6B --device cuda --gpu-memory-utilization 0.9
  tokenloom health worker                    # exit 0 while a worker on this host beats
  tokenloom submit prompts.jsonl --wait      # enqueue a file, show progress, write results
  tokenloom status 3f2c...                   # a job's or a batch's state
  tokenloom cancel 3f2c...                   # cancel a job, or every job of a batch"""


def add_commands(commands) -> None:
    db = commands.add_parser(
        "db",
        help="database schema: upgrade | downgrade | current; prune old jobs",
        description="Run Alembic migrations against [database] url, or prune: delete "
        "finished jobs, batches, files and stream keys older than the retention period.",
    )
    db.add_argument("action", choices=["upgrade", "downgrade", "current", "prune"])
    db.add_argument("revision", nargs="?", help="target revision (default: head / base)")
    add_config_argument(db)
    add_prune_arguments(db)
    db.set_defaults(handler=cmd_db)

    worker = commands.add_parser(
        "worker",
        help="run a Celery worker that hosts one engine",
        epilog=EPILOG,
        description="Consume the model's queue on Redis and run every job through ONE engine that "
        "batches them all; results go to [database] url.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(worker)
    worker.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CLAIM_THREADS,
        help="threads taking messages off the queue (default: %(default)s). Each claims its "
        "message's jobs and returns; the engine runs them, and the worker keeps up to "
        "2 x [scheduler] max_num_seqs jobs claimed, leaving the rest queued for other workers",
    )
    # Celery's spelling of --log-level, kept for existing scripts.
    worker.add_argument(
        "--loglevel", dest="log_level", type=str.lower, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    worker.set_defaults(handler=cmd_worker)

    health = commands.add_parser(
        "health",
        help="container healthchecks: `health worker`",
        description="`tokenloom health worker` exits 0 when a worker process on this host published its "
        "heartbeat (its engine figures in Redis) within [queue] lease_s, else 1 with the reason: the "
        "healthcheck of the compose worker services.",
    )
    health.add_argument("target", choices=["worker"])
    add_config_argument(health)
    health.set_defaults(handler=cmd_health)

    submit = commands.add_parser(
        "submit",
        help="enqueue a JSONL file as a batch of jobs",
        epilog=EPILOG,
        description="Insert one job row per line (bad lines become failed rows with their error) and "
        "send them to the model's queue.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    submit.add_argument("input", metavar="INPUT")
    add_model_arguments(submit)
    submit.add_argument("--project", default="default")
    submit.add_argument("--wait", action="store_true", help="show progress until every job ends, then write results")
    submit.add_argument("-o", "--output", help="results file for --wait (default: <input stem>.results.jsonl)")
    submit.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds")
    submit.set_defaults(handler=cmd_submit)

    status = commands.add_parser("status", help="show a job or a batch")
    status.add_argument("id")
    add_config_argument(status)
    status.set_defaults(handler=cmd_status)

    cancel = commands.add_parser(
        "cancel",
        help="cancel a job or every job of a batch",
        epilog=EPILOG,
        description="Queued jobs end cancelled at once and never start; running ones are aborted in "
        "the engine by their worker and end cancelled with their partial output. Prints the counts "
        "as JSON.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cancel.add_argument("id", help="a job id or a batch id")
    add_config_argument(cancel)
    cancel.set_defaults(handler=cmd_cancel)


def _config(args):
    return load_cli_config(args)


def _sessions(config):
    from tokenloom.store.database import make_session_factory, make_sql_engine

    return make_session_factory(make_sql_engine(config.database.url))


def cmd_db(args) -> int:
    from tokenloom.store import migrate

    config = _config(args)
    if args.action == "prune":
        return cmd_prune(args, config)
    url = config.database.url
    if args.action == "upgrade":
        migrate.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        migrate.downgrade(url, args.revision or "base")
    log.info("database at revision %s", migrate.current(url))
    return 0


# Claiming is a round trip per message, so a few threads keep any engine fed; each thread may hold
# one message it cannot claim yet (the worker is full), and few such messages mean little work
# parked on a busy worker while another is idle.
DEFAULT_CLAIM_THREADS = 4


def cmd_worker(args) -> int:
    from tokenloom.store.celery_app import make_celery, queue_name
    from tokenloom.worker.runtime import get_runtime
    from tokenloom.worker.tasks import register_tasks

    config = _config(args)
    app = make_celery(config.queue.broker_url)
    if args.log_format == "json":  # Celery logs through the root handler of cli/log_setup.py
        app.conf.worker_hijack_root_logger = False
    # The root handler writes to sys.stderr itself; Celery's stdout/stderr proxy would swallow its lines.
    app.conf.worker_redirect_stdouts = False
    register_tasks(app, config)
    runtime = get_runtime(config, app)  # load the model before taking any job
    _drain_on_shutdown(runtime)
    concurrency = args.concurrency
    queue = queue_name(runtime.engine.model_name)
    print(
        f"worker {runtime.worker_id}: queue {queue}, {concurrency} claim threads, up to "
        f"{runtime.runner.max_in_flight} jobs claimed at once",
        file=sys.stderr,
    )
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            "-Q",
            queue,
            "--without-gossip",
            "--without-mingle",
            f"--hostname=tokenloom-{uuid.uuid4().hex[:6]}@{socket.gethostname()}",
            f"--loglevel={args.log_level.upper()}",
        ]
    )
    runtime.close()
    return 0


def _drain_on_shutdown(runtime) -> None:
    """SIGTERM/SIGINT (Celery's warm shutdown): drain for [queue] shutdown_timeout_s, then hand
    the unfinished jobs back; a second signal (cold shutdown) hands them back at once."""
    from celery.signals import worker_shutting_down

    def on_shutdown(sig=None, how=None, exitcode=None, **_):
        runtime.begin_shutdown(0 if how == "Cold" else None)

    worker_shutting_down.connect(on_shutdown, weak=False)


def cmd_health(args) -> int:
    import redis

    from tokenloom.store.engine_stats import heartbeat_ages

    config = _config(args)
    host = socket.gethostname()
    ages = heartbeat_ages(redis.Redis.from_url(config.queue.broker_url), host)
    # A worker beats every lease_s / 3; a full lease without a beat means it is stuck or gone.
    fresh = {worker: age for worker, age in ages.items() if age <= config.queue.lease_s}
    if not fresh:
        seen = ", ".join(f"{worker} {age:.0f} s ago" for worker, age in sorted(ages.items())) or "none"
        print(
            f"error: no worker on {host} published a heartbeat in the last {config.queue.lease_s:g} s "
            f"([queue] lease_s); last seen: {seen}",
            file=sys.stderr,
        )
        return 1
    print(", ".join(f"{worker}: heartbeat {age:.1f} s ago" for worker, age in sorted(fresh.items())))
    return 0


def cmd_submit(args) -> int:
    from tokenloom.store.celery_app import make_celery
    from tokenloom.store.jobs.job_queries import QueueUnavailableError
    from tokenloom.store.jobs.job_service import submit_file

    config = _config(args)
    path = Path(args.input)
    if not path.is_file():
        raise CliError(f"input file not found: {path}")
    model = config.model.name or "tokenloom-demo"
    sessions = _sessions(config)
    try:
        submitted = submit_file(
            sessions,
            make_celery(config.queue.broker_url),
            path,
            model,
            args.project,
            group_size=config.queue.group_size,
        )
    except QueueUnavailableError as exc:
        raise CliError(
            f"{exc}; the batch's rows were marked failed, nothing is left half-queued. "
            f"Check [queue] broker_url and that Redis runs, then submit again"
        ) from exc
    print(
        f"batch {submitted.batch_id}: {submitted.num_jobs} jobs queued for {model}"
        f"{f', {submitted.num_invalid} invalid lines failed' if submitted.num_invalid else ''}",
        file=sys.stderr,
    )
    print(submitted.batch_id)
    if not args.wait:
        return 0
    output = Path(args.output) if args.output else path.with_name(f"{path.stem}.results.jsonl")
    return _wait_and_write(sessions, submitted, output, args.timeout)


def _wait_and_write(sessions, submitted, output: Path, timeout: float | None) -> int:
    from tqdm import tqdm

    from tokenloom.store.jobs.job_service import batch_records, status_counts

    deadline = None if timeout is None else time.monotonic() + timeout
    terminal = ("succeeded", "failed", "cancelled")
    with tqdm(total=submitted.num_jobs, unit="job", file=sys.stderr) as bar:
        while True:
            counts = status_counts(sessions, submitted.batch_id)
            done = sum(counts[s] for s in terminal)
            bar.update(done - bar.n)
            bar.set_postfix(running=counts["running"], failed=counts["failed"])
            if done >= submitted.num_jobs:
                break
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"error: timed out with {submitted.num_jobs - done} jobs unfinished "
                    f"(they keep running; check `tokenloom status {submitted.batch_id}`)",
                    file=sys.stderr,
                )
                return 3
            time.sleep(0.5)
    num_records = 0
    with open(output, "w", encoding="utf-8") as out:
        for record in batch_records(sessions, submitted.batch_id):
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            num_records += 1
    print(f"wrote {num_records} result lines to {output}", file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    from tokenloom.store.jobs.job_service import status_counts
    from tokenloom.store.models import Batch, Job

    sessions = _sessions(_config(args))
    try:
        object_id = uuid.UUID(args.id)
    except ValueError:
        raise CliError(f"{args.id!r} is not a job or batch id (a UUID)") from None
    with sessions() as session:
        job, batch = session.get(Job, object_id), session.get(Batch, object_id)
    if job is not None:
        fields = (
            "status",
            "custom_id",
            "model",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "ttft_s",
            "tpot_s",
            "queue_s",
            "attempts",
            "worker_id",
            "error",
            "output_text",
        )
        print(json.dumps({"id": str(job.id), **{f: _plain(getattr(job, f)) for f in fields}}, indent=2))
        return 0
    if batch is not None:
        counts = status_counts(sessions, batch.id)
        print(json.dumps({"id": str(batch.id), "total": batch.total, "jobs": dict(counts)}, indent=2))
        return 0
    print(f"error: no job or batch {args.id}", file=sys.stderr)
    return 1


def cmd_cancel(args) -> int:
    from tokenloom.store.jobs.job_service import cancel

    sessions = _sessions(_config(args))
    try:
        counts = cancel(sessions, args.id)
    except LookupError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    print(json.dumps(counts, indent=2))
    return 0


def _plain(value):
    return value.value if hasattr(value, "value") else value
