"""Schema migrations (Alembic, the package tokenloom.migrations) driven from code: no alembic.ini.

    from tokenloom.store import migrate
    migrate.upgrade(config.database.url)           # to the newest revision
    migrate.downgrade(url, "base")                 # drop everything
    migrate.current(url)                           # "0001" or None for an empty database
    migrate.head()                                 # the newest revision in migrations/

Each call opens one connection, runs in one transaction (Postgres DDL is transactional) and
closes it. A database that cannot be reached raises RuntimeError naming the URL (password
hidden) and what to check.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.pool import NullPool

from tokenloom.store.database import normalize_url


def _migrations_dir() -> Path:
    # The Alembic scripts ship as the package tokenloom.migrations, so a wheel install finds them too.
    spec = importlib.util.find_spec("tokenloom.migrations")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tokenloom.migrations is not installed as a package: the migrations cannot be found")
    return Path(spec.submodule_search_locations[0])


MIGRATIONS_DIR = _migrations_dir()

__all__ = ["MIGRATIONS_DIR", "alembic_config", "current", "downgrade", "head", "upgrade"]


def alembic_config(url: str) -> Config:
    """An Alembic Config for `url`: script_location is the repo's `migrations/` folder."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Config values go through ConfigParser interpolation: a %-encoded password needs "%%".
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head", *, quiet: bool = False) -> None:
    """`quiet`: no "Running upgrade ..." line per revision (an automatic upgrade of a local file)."""
    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    if quiet:
        alembic_log.setLevel(logging.WARNING)
    try:
        _run(url, lambda config: command.upgrade(config, revision))
    finally:
        alembic_log.setLevel(level)


def downgrade(url: str, revision: str = "base") -> None:
    _run(url, lambda config: command.downgrade(config, revision))


def current(url: str) -> str | None:
    """The revision the database is at; None when it has never been migrated (or was downgraded to base)."""
    engine = _engine(url)
    try:
        with _connect(engine, url) as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision in migrations/ (what `upgrade()` goes to); needs no database."""
    revision = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    if revision is None:  # migrations/ always ships revisions
        raise RuntimeError(f"no migration revisions in {MIGRATIONS_DIR}")
    return revision


def _run(url: str, action) -> None:
    engine = _engine(url)
    try:
        with _connect(engine, url) as connection, connection.begin():
            config = alembic_config(url)
            config.attributes["connection"] = connection  # migrations/env.py uses it as is
            action(config)
    finally:
        engine.dispose()


def _engine(url: str) -> SqlEngine:
    normalized = normalize_url(url)
    try:
        # Plain engine, no pool: SQLite batch migrations must not run with foreign_keys=ON
        # (worker.database turns it on), and a migration needs exactly one connection.
        if normalized.startswith("sqlite"):
            return create_engine(normalized, poolclass=NullPool)
        return create_engine(normalized, poolclass=NullPool, connect_args={"connect_timeout": 10})
    except (ArgumentError, ImportError, ValueError) as exc:
        raise RuntimeError(
            f"database url {_safe_url(url)!r} is not usable ({exc}); "
            "check [database] url in the config file or TOKENLOOM_DATABASE_URL"
        ) from exc


def _connect(engine: SqlEngine, url: str) -> Connection:
    try:
        return engine.connect()
    except (OperationalError, DBAPIError) as exc:
        if normalize_url(url).startswith("sqlite"):
            hint = "and that the database file's directory exists and is writable"
        else:
            hint = "and that Postgres is running and reachable there (host, port, user, database name)"
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise RuntimeError(
            f"cannot connect to the database at {_safe_url(url)}: {reason}. "
            f"Check [database] url in the config file or TOKENLOOM_DATABASE_URL, {hint}."
        ) from exc


def _safe_url(url: str) -> str:
    try:
        return make_url(normalize_url(url)).render_as_string(hide_password=True)
    except Exception:  # unparsable: show only the scheme, the rest may hold a password
        return url.split("://", 1)[0] + "://..."
