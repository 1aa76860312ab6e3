"""What a worker's claim of batch lines costs with 10k, 100k, 1M (and 10M) queued lines.

    python -m bench.claim_scale [--sizes 10000,100000,1000000] [--projects 8] [--admin-url URL]

Creates a fresh database, migrates it, and fills `jobs` with queued batch lines of one model by
server-side INSERT ... SELECT generate_series (--projects projects, each project's lines in
submission order, plus 64 running lines), growing the backlog size by size. At each size it times
(median of REPEATS, each in a transaction rolled back so the backlog stays as it is):

- `claim 32 lines`: JobStore's fair claim as a worker makes it (pick_fair + the claiming UPDATE);
- `queue heads (index)`: pick_fair's read of each project's oldest queued line (queued_heads);
- `queue heads (GROUP BY)`: the same answer as a GROUP BY over the backlog, the query pick_fair made
  before (Postgres reads every queued line for it): the peer the ratio is against;
- `batch counts, big batch` and `..., 10-line batch`: GET /v1/batches/{id}'s request counts and usage
  (batch_counts, from the trigger-kept deltas) of the batch holding 1 in --projects of the lines, and
  of a 10-line batch; `... (row sums)` the same figures summed from the lines, as GET did before.

Not a test: read the ratios (10M within 2x of 10k is the goal for the claim).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import func, select, text

from bench.queue import ADMIN_PG_URL, fresh_database
from tokenloom.store.batches.batch_queries import _summed_rows, batch_counts
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.claim_rows import claim_rows
from tokenloom.store.jobs.fair_claim import pick_fair, queued_heads
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench-model"
REPEATS = 15
CLAIM = 32

FILL_SQL = """
INSERT INTO jobs (id, project, model, endpoint, prompt, params, priority, status, attempts, work_class,
                  line_number, created_at, batch_id)
SELECT gen_random_uuid(), 'project-' || (i % :projects), :model, '/v1/completions', 'a prompt', '{}', 0,
       'queued', 0, 'batch', i, now() - interval '1 day' + i * interval '1 microsecond',
       CASE WHEN i % :projects = 0 THEN CAST(:big_batch AS uuid) END
FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS i
"""
BATCH_SQL = (
    "INSERT INTO batches (id, project, model, endpoint, completion_window, status, total, completed, failed, created_at) "
    "VALUES (:id, 'project-0', :model, '/v1/completions', '24h', 'in_progress', 0, 0, 0, now())"
)
SMALL_BATCH_SQL = """
INSERT INTO jobs (id, project, model, endpoint, prompt, params, priority, status, attempts, work_class,
                  line_number, created_at, batch_id)
SELECT gen_random_uuid(), 'small', 'small-model', '/v1/completions', 'a prompt', '{}', 0, 'succeeded', 1, 'batch',
       i, now(), CAST(:small_batch AS uuid)
FROM generate_series(1, 10) AS i
"""
RUNNING_SQL = """
INSERT INTO jobs (id, project, model, endpoint, prompt, params, priority, status, attempts, work_class,
                  line_number, created_at, worker_id, lease_expires_at)
SELECT gen_random_uuid(), 'project-' || (i % :projects), :model, '/v1/completions', 'a prompt', '{}', 0,
       'running', 1, 'batch', -i, now() - interval '2 days', 'bench-worker', now() + interval '1 hour'
FROM generate_series(1, 64) AS i
"""


def _median_ms(call: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _rolled_back(sessions, work: Callable) -> Callable[[], object]:
    def call():
        with sessions() as session:
            try:
                return work(session)
            finally:
                session.rollback()

    return call


def _group_by_heads(session):
    return session.execute(
        select(Job.project, func.min(Job.created_at))
        .where(Job.model == MODEL, Job.work_class == WorkClass.BATCH, Job.status == JobStatus.QUEUED)
        .group_by(Job.project)
    ).all()


def _claim(session):
    picked = pick_fair(session, MODEL, CLAIM)
    assert len(picked) == CLAIM
    return claim_rows(session, picked, "bench-claimer", 30.0, 3, None)


def run(sizes: list[int], projects: int, admin_url: str) -> dict:
    url = fresh_database(admin_url, "tokenloom_bench_claim_scale")
    engine = make_sql_engine(url)
    sessions = make_session_factory(engine)
    big_batch, small_batch = uuid.uuid4(), uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(text(RUNNING_SQL), {"projects": projects, "model": MODEL})
        for batch_id in (big_batch, small_batch):
            conn.execute(text(BATCH_SQL), {"id": batch_id, "model": MODEL})
        conn.execute(text(SMALL_BATCH_SQL), {"small_batch": small_batch})
    rows = {}
    filled = 0
    for size in sorted(sizes):
        start = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(
                text(FILL_SQL),
                {"projects": projects, "model": MODEL, "first": filled + 1, "last": size, "big_batch": big_batch},
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE jobs"))
        filled = size
        fill_s = time.perf_counter() - start
        index_heads = _rolled_back(sessions, lambda s: queued_heads(s, MODEL))
        group_heads = _rolled_back(sessions, _group_by_heads)
        assert sorted(index_heads()) == sorted(group_heads())
        rows[size] = {
            f"claim {CLAIM} lines": _median_ms(_rolled_back(sessions, _claim)),
            "queue heads (index)": _median_ms(index_heads),
            "queue heads (GROUP BY)": _median_ms(group_heads),
            "batch counts, big batch": _median_ms(lambda: batch_counts(sessions, [big_batch])),
            "batch counts, 10-line batch": _median_ms(lambda: batch_counts(sessions, [small_batch])),
            "batch counts, big batch (row sums)": _median_ms(lambda: _summed_rows(sessions, [big_batch])),
        }
        print(f"{size:>10,} queued lines (filled in {fill_s:.0f} s): {json.dumps(rows[size])}", flush=True)
    engine.dispose()
    smallest, largest = min(rows), max(rows)
    return {
        "projects": projects,
        "ms": {f"{size}": {k: round(v, 2) for k, v in row.items()} for size, row in rows.items()},
        f"ratio {largest} / {smallest}": {k: round(rows[largest][k] / rows[smallest][k], 2) for k in rows[smallest]},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="backlog sizes, comma-separated")
    parser.add_argument("--projects", type=int, default=8)
    parser.add_argument("--admin-url", default=ADMIN_PG_URL)
    args = parser.parse_args(argv)
    result = run([int(s) for s in args.sizes.split(",")], args.projects, args.admin_url)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "claim_scale.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
