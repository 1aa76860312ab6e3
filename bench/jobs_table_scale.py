"""What /metrics, /v1/stats, GET /v1/jobs and admission cost with 10,000 vs 1,000,000 job rows.

    python -m bench.jobs_table_scale [--admin-url URL]

Creates a fresh database, migrates it, fills `jobs` with a realistic mix by server-side
INSERT ... SELECT generate_series (90% succeeded with timings and tokens, 5% failed, 3%
cancelled, 2% queued or running among the newest; 5 models x 5 projects), times each read as the
endpoints make it (median of REPEATS calls), grows the table to 1,000,000 rows and times again.
Row i is i * SPACING_S seconds old, so growing adds older rows: the newest rows, and so the
/v1/stats window, are the same at both sizes. The "scan" rows time the aggregate queries the
endpoints ran before the jobs table kept its aggregates, for scale. Not a test: read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from tokenloom.store import migrate
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs import job_queries, job_stats

ADMIN_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SIZES = (10_000, 1_000_000)
REPEATS = 20
SPACING_S = 2.0  # seconds between successive rows' created_at: 1M rows span ~23 days
STATS_WINDOW_S = 300.0
DEEP_PAGE_FRACTION = 0.9  # the deep page starts after this fraction of the table (newest first)

FILL_SQL = """
INSERT INTO jobs (id, project, model, endpoint, prompt, params, priority, status, attempts, created_at,
                  admitted_at, first_token_at, finished_at, prompt_tokens, completion_tokens, queue_s, ttft_s, tpot_s)
SELECT gen_random_uuid(), 'project-' || (i % 5), 'model-' || ((i / 5) % 5), '/v1/completions', 'a prompt', '{}', 0,
       kind, 1, created, created + q * interval '1 second',
       CASE WHEN kind = 'succeeded' THEN created + (q + t) * interval '1 second' END,
       CASE WHEN kind IN ('queued', 'running') THEN NULL ELSE created + (q + t + 0.5) * interval '1 second' END,
       CASE WHEN kind = 'succeeded' THEN 20 + i % 200 END, CASE WHEN kind = 'succeeded' THEN 1 + i % 64 END,
       CASE WHEN kind = 'succeeded' THEN q END, CASE WHEN kind = 'succeeded' THEN t END,
       CASE WHEN kind = 'succeeded' THEN t / 20 END
FROM (
    SELECT i, now() - i * CAST(:spacing AS double precision) * interval '1 second' AS created, random() * 5 AS q, random() AS t,
           CASE WHEN i % 100 < 90 THEN 'succeeded' WHEN i % 100 < 95 THEN 'failed'
                WHEN i % 100 < 98 OR i > 20000 THEN 'cancelled' WHEN i % 2 = 0 THEN 'queued' ELSE 'running' END AS kind
    FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS i
) AS rows
"""
SCAN_SQL = {  # the full-table aggregates /metrics ran without the trigger-kept aggregates
    "scan: jobs by status + tokens": "SELECT model, status, count(*), sum(prompt_tokens), sum(completion_tokens) "
    "FROM jobs GROUP BY model, status",
    "scan: 3 histograms": " ; ".join(
        f"SELECT model, count({column}), sum({column}), "
        + ", ".join(f"sum(CASE WHEN {column} <= {bound} THEN 1 ELSE 0 END)" for bound in bounds)
        + f" FROM jobs WHERE {column} IS NOT NULL GROUP BY model"
        for column, bounds in job_stats.HISTOGRAM_BOUNDS.items()
    ),
}


def run(database_url_admin: str = ADMIN_PG_URL) -> dict:
    """{"latency_ms": {query: {size: median ms}}, "ratio": {query: ms at 1M / ms at 10k}}."""
    name = f"tokenloom_bench_table_{uuid.uuid4().hex[:8]}"
    admin = create_engine(database_url_admin, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(database_url_admin).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        engine = make_sql_engine(url)
        sessions = make_session_factory(engine)
        latency: dict[str, dict[int, float]] = {}
        filled = 0
        for size in SIZES:
            with engine.begin() as conn:
                conn.execute(text(FILL_SQL), {"first": filled + 1, "last": size, "spacing": SPACING_S})
                conn.execute(text("ANALYZE jobs"))
            filled = size
            for query, ms in _measure(sessions, engine, size).items():
                latency.setdefault(query, {})[size] = ms
        engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    small, large = SIZES
    return {"latency_ms": latency, "ratio": {q: by_size[large] / by_size[small] for q, by_size in latency.items()}}


def _measure(sessions, engine, size: int) -> dict[str, float]:
    with engine.connect() as conn:
        deep_cursor = conn.execute(
            text("SELECT id FROM jobs ORDER BY created_at DESC, id DESC OFFSET :n LIMIT 1"),
            {"n": int(size * DEEP_PAGE_FRACTION)},
        ).scalar_one()
        project_cursor = conn.execute(
            text("SELECT id FROM jobs WHERE project = 'project-1' ORDER BY created_at DESC, id DESC OFFSET :n LIMIT 1"),
            {"n": int(size * DEEP_PAGE_FRACTION / 5)},
        ).scalar_one()

    def metrics_scrape() -> None:  # what GET /metrics reads from the database
        job_stats.jobs_by_status(sessions)
        job_stats.token_totals(sessions)
        for column in job_stats.HISTOGRAM_BOUNDS:
            job_stats.histograms(sessions, column)

    calls: dict[str, Callable[[], object]] = {
        "/metrics (status, tokens, 3 histograms)": metrics_scrape,
        f"/v1/stats (window {STATS_WINDOW_S:.0f} s)": lambda: job_stats.window_timings(sessions, STATS_WINDOW_S),
        "admission (open jobs of a project)": lambda: job_stats.open_jobs(sessions, "project-1"),
        "/v1/jobs?limit=100 (admin, first page)": lambda: job_queries.list_jobs(sessions, None, limit=100),
        "/v1/jobs?limit=100 (admin, deep page)": lambda: job_queries.list_jobs(
            sessions, None, limit=100, after=deep_cursor
        ),
        "/v1/jobs?limit=100 (project, deep page)": lambda: job_queries.list_jobs(
            sessions, "project-1", limit=100, after=project_cursor
        ),
    }
    for label, sql in SCAN_SQL.items():
        calls[label] = lambda sql=sql: _run_sql(engine, sql)
    return {label: _median_ms(call) for label, call in calls.items()}


def _run_sql(engine, sql: str) -> None:
    with engine.connect() as conn:
        for statement in sql.split(" ; "):
            conn.execute(text(statement)).all()


def _median_ms(call: Callable[[], object]) -> float:
    call()  # warm: plans, connections, buffers
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def format_table(result: dict) -> str:
    small, large = SIZES
    lines = [f"| query | {small:,} rows ms | {large:,} rows ms | ratio |", "| --- | ---: | ---: | ---: |"]
    for query, by_size in result["latency_ms"].items():
        lines.append(f"| {query} | {by_size[small]:.2f} | {by_size[large]:.2f} | {result['ratio'][query]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--admin-url", default=ADMIN_PG_URL, help="a Postgres database to create the bench one from")
    print(format_table(run(parser.parse_args(argv).admin_url)))


if __name__ == "__main__":
    main()
