"""What a worker's claim of batch lines costs with 10k, 100k, 1M (and 10M) queued lines.

    python -m bench.claim_scale [--sizes 10000,100000,1000000] [--projects 8] [--admin-url URL]

Creates a fresh database, migrates it, and fills `jobs` with queued batch lines of one model by
server-side INSERT ... SELECT generate_series (--projects projects, each project's lines in
submission order, plus 64 running lines), growing the backlog size by size. At each size it times
(median of REPEATS, each in a transaction rolled back so the backlog stays as it is):

- `claim 32 lines`: JobStore's fair claim as a worker makes it (pick_fair + the claiming UPDATE);
- `queue heads (index)`: pick_fair's read of each project's oldest queued line (queued_heads);
- `queue heads (GROUP BY)`: the same answer as a GROUP BY over the backlog, the query pick_fair made
  before (Postgres reads every queued line for it): the peer the ratio is against.

Not a test: read the ratios (10M within 2x of 10k is the goal for the claim).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import func, select, text

from bench.queue import ADMIN_PG_URL, fresh_database
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
                  line_number, created_at)
SELECT gen_random_uuid(), 'project-' || (i % :projects), :model, '/v1/completions', 'a prompt', '{}', 0,
       'queued', 0, 'batch', i, now() - interval '1 day' + i * interval '1 microsecond'
FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS i
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
    with engine.begin() as conn:
        conn.execute(text(RUNNING_SQL), {"projects": projects, "model": MODEL})
    rows = {}
    filled = 0
    for size in sorted(sizes):
        start = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(text(FILL_SQL), {"projects": projects, "model": MODEL, "first": filled + 1, "last": size})
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
