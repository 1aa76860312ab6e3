"""The real-service fixtures (tests/services.py): Postgres databases, SQLite files; and a Redis
database the worker tests that touch Redis keys flush before and after each test."""

import pytest
import redis

from tests.services import pg_empty_url, pg_url, sqlite_url  # noqa: F401 - fixtures, requested by name

REDIS_URL = "redis://127.0.0.1:6379/15"  # a database of its own: the tests flush it


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
