"""Alembic environment for tokenloom. There is no alembic.ini: tokenloom.store.migrate builds the Config.

The database comes from `config.attributes["connection"]` when the caller passes an open
connection (tokenloom.store.migrate does), otherwise from the `sqlalchemy.url` main option.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from tokenloom.store.database import normalize_url
from tokenloom.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError(
            "no database url: set the alembic option sqlalchemy.url (tokenloom.store.migrate.alembic_config does)"
        )
    return normalize_url(url)


def _options(dialect_name: str) -> dict:
    # SQLite cannot ALTER most things in place: batch mode copies the table instead.
    return dict(target_metadata=target_metadata, compare_type=True, render_as_batch=dialect_name == "sqlite")


def run_migrations_offline() -> None:
    url = _url()
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **_options(url.split(":", 1)[0].split("+", 1)[0]),
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection) -> None:
    context.configure(connection=connection, **_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            _run(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
