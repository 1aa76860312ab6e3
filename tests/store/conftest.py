"""The real-service fixtures (tests/services.py): Postgres databases, SQLite files."""

from tests.services import pg_empty_url, pg_url, sqlite_url  # noqa: F401 - fixtures, requested by name
