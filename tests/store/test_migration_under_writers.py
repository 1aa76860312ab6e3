"""Revision 0011 on a jobs table of many rows while writers keep writing: no writer waits a second.

The migration reads and rewrites nothing of `jobs` (no backfill, no index on it), so the locks its
DDL takes last milliseconds whatever the table's size; it takes them in the order the stack's
writers do (batches, then jobs), so it never deadlocks with them. A writer thread records lines
and submits batches through the whole upgrade; each of its transactions is timed.
"""

from __future__ import annotations

import threading
import time
import uuid

from sqlalchemy import text

from tests.services import fresh_pg_database
from tokenloom.store import migrate
from tokenloom.store.batches.batch_queries import batch_counts
from tokenloom.store.database import make_session_factory, make_sql_engine

ROWS = 200_000
MOST_WAIT_S = 1.0


BATCH_SQL = (
    "INSERT INTO batches (id, project, endpoint, completion_window, status, total, completed, failed, created_at) "
    "VALUES (:id, 'p', '/v1/completions', '24h', 'in_progress', 0, 0, 0, now())"
)
LINES_SQL = (
    "INSERT INTO jobs (id, batch_id, project, model, endpoint, prompt, params, status, work_class, priority, "
    "attempts, created_at) SELECT gen_random_uuid(), :id, 'p', 'm', '/v1/completions', 'x', '{}', 'queued', "
    "'batch', 0, 0, now() FROM generate_series(1, :rows)"
)


def _fill(engine, batch_id: uuid.UUID) -> None:
    with engine.begin() as conn:
        conn.execute(text(BATCH_SQL), {"id": batch_id})
        conn.execute(text(LINES_SQL), {"id": batch_id, "rows": ROWS})


class Writer(threading.Thread):
    """Writes as the stack does, until stopped, timing each transaction: a worker's UPDATE recording
    a line, and the API's submission of a batch (its row, then its lines, in one transaction)."""

    def __init__(self, engine, batch_id: uuid.UUID):
        super().__init__(daemon=True)
        self.engine, self.batch_id = engine, batch_id
        self.waits: list[float] = []
        self.lines_recorded = 0
        self.stop = threading.Event()
        self.started_writing = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                start = time.perf_counter()
                with self.engine.begin() as conn:
                    self.lines_recorded += conn.execute(
                        text(
                            "UPDATE jobs SET status = 'succeeded', prompt_tokens = 3 WHERE id = (SELECT id FROM jobs "
                            "WHERE batch_id = :id AND status = 'queued' LIMIT 1)"
                        ),
                        {"id": self.batch_id},
                    ).rowcount
                self.waits.append(time.perf_counter() - start)
                start = time.perf_counter()
                with self.engine.begin() as conn:
                    new_batch = uuid.uuid4()
                    conn.execute(text(BATCH_SQL), {"id": new_batch})
                    conn.execute(text(LINES_SQL), {"id": new_batch, "rows": 2})
                self.waits.append(time.perf_counter() - start)
                self.started_writing.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.started_writing.set()


def test_upgrading_to_0011_under_writers_keeps_every_wait_under_a_second():
    with fresh_pg_database() as url:
        migrate.upgrade(url, "0010")
        engine = make_sql_engine(url)
        batch_id = uuid.uuid4()
        _fill(engine, batch_id)
        writer = Writer(engine, batch_id)
        writer.start()
        assert writer.started_writing.wait(60) and writer.error is None, writer.error
        before = len(writer.waits)
        started = time.perf_counter()
        migrate.upgrade(url)
        migration_s = time.perf_counter() - started
        during = len(writer.waits) - before
        done_after = len(writer.waits)
        while len(writer.waits) < done_after + 5 and writer.error is None:  # it goes on writing after
            writer.join(0.05)
        writer.stop.set()
        writer.join(30)
        assert writer.error is None, writer.error
        assert max(writer.waits) < MOST_WAIT_S, (max(writer.waits), migration_s)
        assert during >= 0 and len(writer.waits) > before
        # The batch made before the migration is still counted right (from its rows), writes included.
        counts = batch_counts(make_session_factory(engine), [batch_id])[batch_id]
        assert counts.total == ROWS and counts.completed == writer.lines_recorded
        engine.dispose()
