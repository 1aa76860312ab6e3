"""SQLAlchemy engine and sessions for `[database] url`: Postgres (psycopg 3) or SQLite, one code path."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, Result, create_engine, event
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    """Accept the usual spellings of a Postgres URL and use the psycopg 3 driver for all of them."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_sql_engine(url: str) -> SqlEngine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # pre_ping: a connection dropped by a Postgres restart is replaced instead of failing a job.
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched. Session.execute returns a CursorResult for them, but is
    typed to return Result, which has no rowcount."""
    return cast(CursorResult[Any], result).rowcount


def make_session_factory(engine: SqlEngine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets readers (status queries) run while the runner writes; foreign keys are off by default.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
