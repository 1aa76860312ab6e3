"""Alembic migrations produce exactly store/models.py, and round-trip cleanly, on SQLite and Postgres."""

from __future__ import annotations

import uuid

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, insert, inspect, text
from sqlalchemy.pool import NullPool

from tokenloom.store import migrate
from tokenloom.store.database import normalize_url
from tokenloom.store.models import ApiKey, Base, Batch, Job

BATCH_ID, JOB_ID = uuid.UUID(int=1), uuid.UUID(int=2)


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_empty_url")


def _diff(url: str) -> list:
    engine = create_engine(normalize_url(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = create_engine(normalize_url(url), poolclass=NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _head() -> str:
    return ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_current_head()


def test_single_head_is_the_batch_counters_revision():
    assert _head() == migrate.head() == "0011"


def test_upgrade_matches_models(empty_url):
    assert migrate.current(empty_url) is None
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == _head()
    assert _tables(empty_url) == set(Base.metadata.tables) | {"alembic_version"}
    assert _diff(empty_url) == []


def test_downgrade_to_base_and_upgrade_again(empty_url):
    migrate.upgrade(empty_url)
    migrate.downgrade(empty_url)
    assert migrate.current(empty_url) is None
    assert _tables(empty_url) <= {"alembic_version"}
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == _head()
    assert _diff(empty_url) == []
    migrate.upgrade(empty_url)  # already at head: a no-op
    assert migrate.current(empty_url) == _head()


def test_0002_keeps_existing_rows_both_ways(empty_url):
    """Upgrading a queue database that already holds jobs (SQLite copies the tables) loses nothing."""
    migrate.upgrade(empty_url, "0001")
    engine = create_engine(normalize_url(empty_url), poolclass=NullPool)
    try:
        with engine.begin() as conn:
            # Only columns 0001 has: the rest are the models' Python defaults, none of them new.
            conn.execute(insert(Batch).values(id=BATCH_ID, total=1))
            conn.execute(insert(Job).values(id=JOB_ID, batch_id=BATCH_ID, custom_id="c1", model="m"))
        migrate.upgrade(empty_url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT custom_id, result_record FROM jobs")).all() == [("c1", None)]
            assert conn.execute(text("SELECT total, run_key FROM batches")).all() == [(1, None)]
        migrate.downgrade(empty_url, "0001")
        assert migrate.current(empty_url) == "0001"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT custom_id FROM jobs")).all() == [("c1",)]
            assert "result_record" not in {c["name"] for c in inspect(conn).get_columns("jobs")}
    finally:
        engine.dispose()


def test_0010_gives_existing_keys_the_safe_allowance_and_downgrades(empty_url):
    """Keys made before 0010 may neither lift /v1/jobs work into the interactive class nor set a
    priority below 0 (docs/priority.md); downgrading drops the allowance and keeps the keys."""
    migrate.upgrade(empty_url, "0009")
    engine = create_engine(normalize_url(empty_url), poolclass=NullPool)
    key = dict(id=uuid.UUID(int=3), project="p", name="old", key_prefix="tlk-old", key_hash="h")
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO api_keys (id, project, name, key_prefix, key_hash, is_admin, created_at) "
                    "VALUES (:id, :project, :name, :key_prefix, :key_hash, false, CURRENT_TIMESTAMP)"
                ),
                {**key, "id": key["id"].hex if empty_url.startswith("sqlite") else key["id"]},
            )
        migrate.upgrade(empty_url, "0010")
        with engine.connect() as conn:
            row = conn.execute(text("SELECT name, allow_priority_tier, min_priority FROM api_keys")).one()
        assert (row[0], bool(row[1]), row[2]) == ("old", False, 0)
        assert ApiKey.__table__.c.min_priority.server_default.arg == "0"  # the model says what 0010 wrote
        migrate.downgrade(empty_url, "0009")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM api_keys")).all() == [("old",)]
            columns = {c["name"] for c in inspect(conn).get_columns("api_keys")}
        assert not columns & {"allow_priority_tier", "min_priority"}
    finally:
        engine.dispose()


def test_alembic_config_points_at_the_repo_migrations():
    config = migrate.alembic_config("postgres://user:p%40ss@db/x")
    assert config.get_main_option("script_location") == str(migrate.MIGRATIONS_DIR)
    assert (migrate.MIGRATIONS_DIR / "env.py").is_file()
    # normalized to psycopg 3, and the %-escape survives ConfigParser interpolation
    assert config.get_main_option("sqlalchemy.url") == "postgresql+psycopg://user:p%40ss@db/x"


def test_unreachable_postgres_is_a_clear_error():
    url = "postgresql://tokenloom:hunter2@127.0.0.1:1/tokenloom"
    with pytest.raises(RuntimeError) as excinfo:
        migrate.upgrade(url)
    message = str(excinfo.value)
    assert "hunter2" not in message
    assert "127.0.0.1:1/tokenloom" in message
    assert "[database] url" in message and "TOKENLOOM_DATABASE_URL" in message
    assert "Postgres is running" in message


def test_unopenable_sqlite_is_a_clear_error(tmp_path):
    url = f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}"
    with pytest.raises(RuntimeError, match="TOKENLOOM_DATABASE_URL"):
        migrate.current(url)
