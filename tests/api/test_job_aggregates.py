"""The trigger-kept job aggregates (store/jobs/job_aggregates.py) against a direct GROUP BY over the rows,
on a real Postgres: after inserts, claims, finishes, cancels and deletes, concurrent transactions
from threads, compaction, and the migration's backfill; and SQLite's fallback to the rows."""

from __future__ import annotations

import importlib.util
import random
import threading
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, delete, func, insert, select, text, update
from sqlalchemy.pool import NullPool

from tests.services import fresh_pg_database
from tokenloom.store import migrate
from tokenloom.store.database import make_session_factory, make_sql_engine, normalize_url
from tokenloom.store.jobs import job_aggregates, job_stats
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus, job_count_deltas, utcnow

MODELS = ("model-a", "model-b")
PROJECTS = ("lab-a", "lab-b")


@pytest.fixture
def sessions():
    with fresh_pg_database() as url:
        migrate.upgrade(url)
        engine = make_sql_engine(url)
        yield make_session_factory(engine)
        engine.dispose()


def direct_by_status(sessions) -> dict[tuple[str, str], int]:
    with sessions() as session:
        rows = session.execute(select(Job.model, Job.status, func.count()).group_by(Job.model, Job.status))
        return {(model, status.value): n for model, status, n in rows}


def direct_tokens(sessions) -> dict[str, tuple[int, int]]:
    with sessions() as session:
        rows = session.execute(
            select(
                Job.model,
                func.coalesce(func.sum(Job.prompt_tokens), 0),
                func.coalesce(func.sum(Job.completion_tokens), 0),
            ).group_by(Job.model)
        )
        return {model: (int(p), int(c)) for model, p, c in rows}


def direct_histograms(sessions) -> dict[str, dict[str, job_stats.Histogram]]:
    return {
        column: job_stats._histograms_from_rows(sessions, column, bounds)
        for column, bounds in job_stats.HISTOGRAM_BOUNDS.items()
    }


def aggregated_histograms(sessions) -> dict[str, dict[str, job_stats.Histogram]]:
    return {column: job_stats.histograms(sessions, column) for column in job_stats.HISTOGRAM_BOUNDS}


def per_model(histograms: dict) -> dict:
    """(model, class) -> histogram, merged per model."""
    merged: dict = {}
    for (model, _), hist in histograms.items():
        if model in merged:
            old = merged[model]
            hist = job_stats.Histogram(
                [a + b for a, b in zip(old.buckets, hist.buckets)], old.count + hist.count, old.total + hist.total
            )
        merged[model] = hist
    return merged


def assert_matches_rows(sessions, by_class: bool = True) -> None:
    """`by_class=False` where deltas were recorded before revision 0009 (they have no class)."""
    assert job_stats.jobs_by_status(sessions) == direct_by_status(sessions)
    assert job_stats.token_totals(sessions) == direct_tokens(sessions)
    for column, expected in direct_histograms(sessions).items():
        got = aggregated_histograms(sessions)[column]
        if not by_class:
            got, expected = per_model(got), per_model(expected)
        assert got.keys() == expected.keys()
        for model, hist in expected.items():
            assert (got[model].buckets, got[model].count) == (hist.buckets, hist.count)
            assert got[model].total == pytest.approx(hist.total)
    for project in PROJECTS:
        with sessions() as session:
            expected_open = session.execute(
                select(func.count())
                .select_from(Job)
                .where(Job.project == project, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
            ).scalar_one()
        assert job_stats.open_jobs(sessions, project) == expected_open


def new_jobs(rng: random.Random, n: int) -> list[Job]:
    # Every class, so the histograms' per-class keys (revision 0009) are checked against the rows.
    return [
        Job(
            id=uuid.uuid4(),
            model=rng.choice(MODELS),
            project=rng.choice(PROJECTS),
            prompt="p",
            params={},
            work_class=rng.choice(list(WorkClass)),
        )
        for _ in range(n)
    ]


def finish_values(rng: random.Random, *, with_e2e: bool = True) -> dict:
    # Values on bucket bounds, between them, and above the largest (the +Inf bucket).
    values = dict(
        status=JobStatus.SUCCEEDED,
        finished_at=utcnow(),
        prompt_tokens=rng.randint(1, 500),
        completion_tokens=rng.randint(1, 64),
        ttft_s=rng.choice([0.01, 0.3, 2.5, 7.0, 1000.0]),
        tpot_s=rng.choice([0.001, 0.02, 0.5, 9.0]),
        queue_s=rng.choice([0.0, 0.05, 42.0, 5000.0]),
    )
    if with_e2e:  # revision 0006's column
        values["e2e_s"] = rng.choice([0.1, 0.3, 4.2, 7680.0, 100000.0])
    return values


def lifecycle(sessions, rng: random.Random, n: int = 12) -> None:
    """Insert, claim, finish, fail, cancel and re-finish a group of jobs, one statement per step."""
    jobs = new_jobs(rng, n)
    with sessions.begin() as session:
        session.add_all(jobs)
    ids = [j.id for j in jobs]
    with sessions.begin() as session:  # a claim of a group
        session.execute(update(Job).where(Job.id.in_(ids[: n // 2 + 2])).values(status=JobStatus.RUNNING))
    with sessions.begin() as session:
        for job_id in ids[: n // 2]:
            session.execute(update(Job).where(Job.id == job_id).values(**finish_values(rng)))
    with sessions.begin() as session:
        session.execute(
            update(Job)
            .where(Job.id.in_(ids[n // 2 : n // 2 + 2]))
            .values(status=JobStatus.FAILED, finished_at=utcnow(), error="boom", queue_s=0.2)
        )
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.id.in_(ids[-2:])).values(status=JobStatus.CANCELLED))
    with sessions.begin() as session:  # a finished job's timings rewritten: old values out, new in
        session.execute(update(Job).where(Job.id == ids[0]).values(**finish_values(rng)))
    with sessions.begin() as session:  # a lease renewal: no aggregate changes
        session.execute(update(Job).where(Job.id.in_(ids)).values(lease_expires_at=utcnow()))


def test_aggregates_equal_the_rows_after_inserts_claims_finishes_and_cancels(sessions):
    rng = random.Random(0)
    for _ in range(4):
        lifecycle(sessions, rng)
    assert_matches_rows(sessions)


def test_a_rolled_back_transaction_leaves_the_aggregates_alone(sessions):
    lifecycle(sessions, random.Random(1))
    before = job_stats.jobs_by_status(sessions)
    with pytest.raises(RuntimeError), sessions.begin() as session:
        session.add_all(new_jobs(random.Random(2), 5))
        session.flush()
        raise RuntimeError("abort")
    assert job_stats.jobs_by_status(sessions) == before
    assert_matches_rows(sessions)


def test_deletes_lower_status_counts_but_never_token_or_histogram_counters(sessions):
    rng = random.Random(3)
    for _ in range(3):
        lifecycle(sessions, rng)
    tokens, hists = job_stats.token_totals(sessions), aggregated_histograms(sessions)
    with sessions.begin() as session:
        session.execute(delete(Job).where(Job.status.in_([JobStatus.SUCCEEDED, JobStatus.CANCELLED])))
    assert job_stats.jobs_by_status(sessions) == direct_by_status(sessions)
    assert job_stats.token_totals(sessions) == tokens
    assert aggregated_histograms(sessions) == hists
    with sessions.begin() as session:
        session.execute(text("TRUNCATE jobs"))
    assert job_stats.jobs_by_status(sessions) == {}
    assert job_stats.token_totals(sessions) == tokens


def test_concurrent_transactions_from_threads_keep_the_aggregates_exact(sessions):
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            rng = random.Random(seed)
            for _ in range(5):
                lifecycle(sessions, rng, n=8)
                if seed % 2:  # compactions running beside the writers
                    job_aggregates.compact(sessions, job_aggregates.COUNT_DELTAS)
                    job_aggregates.compact(sessions, job_aggregates.HISTOGRAM_DELTAS)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert_matches_rows(sessions)


def test_compaction_leaves_one_row_per_key_and_the_same_sums(sessions):
    rng = random.Random(4)
    for _ in range(3):
        lifecycle(sessions, rng)
    expected = job_stats.jobs_by_status(sessions), job_stats.token_totals(sessions), aggregated_histograms(sessions)
    job_aggregates.compact(sessions, job_aggregates.COUNT_DELTAS)
    job_aggregates.compact(sessions, job_aggregates.HISTOGRAM_DELTAS)
    with sessions() as session:
        num_rows = session.execute(select(func.count()).select_from(job_count_deltas)).scalar_one()
        num_keys = session.execute(
            select(func.count()).select_from(
                select(job_count_deltas.c.model, job_count_deltas.c.project, job_count_deltas.c.status)
                .distinct()
                .subquery()
            )
        ).scalar_one()
    assert num_rows == num_keys
    assert (
        job_stats.jobs_by_status(sessions),
        job_stats.token_totals(sessions),
        aggregated_histograms(sessions),
    ) == expected
    assert_matches_rows(sessions)


def test_a_reader_compacts_once_the_deltas_outgrow_the_threshold(sessions, monkeypatch):
    monkeypatch.setattr(job_aggregates, "COMPACT_AFTER_ROWS", 10)
    for statement in range(30):  # one delta row per statement
        with sessions.begin() as session:
            session.add(Job(model="model-a", project="lab-a", prompt=str(statement), params={}))
    job_stats.jobs_by_status(sessions)
    with sessions() as session:
        assert session.execute(select(func.count()).select_from(job_count_deltas)).scalar_one() == 1
    assert job_stats.jobs_by_status(sessions) == {("model-a", "queued"): 30}


def test_the_stats_window_reads_through_the_finished_at_index(sessions):
    with sessions() as session:
        session.execute(text("SET enable_seqscan = off"))
        plan = "\n".join(
            session.execute(
                text("EXPLAIN SELECT model FROM jobs WHERE finished_at >= now() - interval '5 minutes'")
            ).scalars()
        )
    assert "ix_jobs_finished_at" in plan


def load_migration(file_name: str):
    path = migrate.MIGRATIONS_DIR / "versions" / file_name
    spec = importlib.util.spec_from_file_location(f"migration_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_migrations_copy_the_histogram_bounds_of_job_stats():
    counters, e2e = load_migration("0004_job_counters.py"), load_migration("0006_e2e_latency.py")
    assert {**counters.HISTOGRAM_BOUNDS, e2e.METRIC: e2e.E2E_BOUNDS} == job_stats.HISTOGRAM_BOUNDS
    # 0006 restores 0004's trigger functions on downgrade: the same metrics, the same SQL.
    assert e2e.METRICS_0004 == tuple(counters.HISTOGRAM_BOUNDS)
    for event, body in e2e._histogram_functions(e2e.METRICS_0004).items():
        assert body == counters.TRIGGER_FUNCTIONS[event]


def test_downgrading_0006_drops_the_e2e_histogram_and_keeps_the_other_triggers_working():
    with fresh_pg_database() as url:
        migrate.upgrade(url)
        engine = make_sql_engine(url)
        try:
            sessions = make_session_factory(engine)
            lifecycle(sessions, random.Random(7))
            assert job_stats.histograms(sessions, "e2e_s")
            engine.dispose()
            migrate.downgrade(url, "0005")
            with sessions.begin() as session:  # fails if a trigger function still names e2e_s
                session.execute(update(Job).where(Job.status == JobStatus.SUCCEEDED).values(ttft_s=0.7))
            with sessions() as session:
                metrics = set(session.execute(text("SELECT DISTINCT metric FROM job_histogram_deltas")).scalars())
                bounded = set(session.execute(text("SELECT DISTINCT metric FROM job_histogram_bounds")).scalars())
            assert metrics == bounded == {"ttft_s", "tpot_s", "queue_s"}
            # Read with SQL of that revision's shape (this code's reader knows the classes of 0009).
            with sessions() as session:
                got = {
                    model: (int(n), float(total))
                    for model, n, total in session.execute(
                        text(
                            "SELECT model, sum(num_values), sum(value_sum) FROM job_histogram_deltas "
                            "WHERE metric = 'ttft_s' GROUP BY model HAVING sum(num_values) <> 0"
                        )
                    )
                }
                expected = {
                    model: (int(n), float(total))
                    for model, n, total in session.execute(
                        text(
                            "SELECT model, count(ttft_s), sum(ttft_s) FROM jobs WHERE ttft_s IS NOT NULL GROUP BY model"
                        )
                    )
                }
            assert {m: n for m, (n, _) in got.items()} == {m: n for m, (n, _) in expected.items()}
            assert [got[m][1] for m in expected] == pytest.approx([total for _, total in expected.values()])
            engine.dispose()
            migrate.upgrade(url)
            lifecycle(sessions, random.Random(8))
            assert job_stats.histograms(sessions, "e2e_s")
            assert_matches_rows(sessions, by_class=False)
        finally:
            engine.dispose()


def test_the_migration_backfills_the_aggregates_from_existing_rows():
    with fresh_pg_database() as url:
        migrate.upgrade(url, "0003")
        rng = random.Random(5)
        engine = create_engine(normalize_url(url), poolclass=NullPool)
        with engine.begin() as conn:
            for i in range(40):  # only columns revision 0003 has
                finished = finish_values(rng, with_e2e=False) if i % 3 else dict(status=JobStatus.QUEUED)
                conn.execute(
                    insert(Job).values(
                        id=uuid.uuid4(),
                        model=rng.choice(MODELS),
                        project=rng.choice(PROJECTS),
                        prompt="p",
                        params={},
                        **finished,
                    )
                )
        engine.dispose()
        migrate.upgrade(url)
        app_engine = make_sql_engine(url)
        try:
            sessions = make_session_factory(app_engine)
            assert sum(job_stats.jobs_by_status(sessions).values()) == 40
            assert_matches_rows(sessions, by_class=False)  # 0004 backfilled them before classes existed
        finally:
            app_engine.dispose()


def test_sqlite_computes_the_same_figures_from_the_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    migrate.upgrade(url)
    engine = make_sql_engine(url)
    try:
        sessions = make_session_factory(engine)
        assert not job_stats.has_aggregates(sessions)
        rng = random.Random(6)
        lifecycle(sessions, rng)
        with sessions() as session:
            assert session.execute(select(func.count()).select_from(job_count_deltas)).scalar_one() == 0
        assert job_stats.jobs_by_status(sessions) == direct_by_status(sessions)
        assert sum(job_stats.jobs_by_status(sessions).values()) == 12
        assert job_stats.token_totals(sessions) == direct_tokens(sessions)
        assert aggregated_histograms(sessions) == direct_histograms(sessions)
        assert len(job_stats.window_timings(sessions, timedelta(hours=1).total_seconds())) >= 1
    finally:
        engine.dispose()
