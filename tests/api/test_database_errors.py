"""Database failures seen by the API, without a worker: an unreachable database (or Redis) is a 503
with Retry-After (a Postgres restart looks like this), and text the database cannot hold (U+0000) is
a 400 naming the field, never a 500."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import stack_config
from tests.services import fresh_pg_database
from tokenloom.api.app import create_app
from tokenloom.api.served_model import ServedModel
from tokenloom.store import migrate

ADMIN = {"Authorization": "Bearer admin-key"}


def app_on(checkpoint, url: str) -> TestClient:
    config = stack_config(checkpoint, url)
    return TestClient(create_app(config, admin_key="admin-key", served=ServedModel.load(config.model, config.sampling)))


def test_an_unreachable_database_is_a_503_with_retry_after(api_checkpoint):
    with app_on(api_checkpoint, "postgresql+psycopg://postgres@127.0.0.1:9/nowhere") as client:
        for method, path, body in (
            ("POST", "/v1/jobs", {"prompt": "x"}),
            ("GET", "/v1/batches", None),
            ("GET", "/v1/files/file-abc", None),
            ("GET", "/v1/stats", None),
        ):
            response = client.request(method, path, json=body, headers=ADMIN)
            assert response.status_code == 503, (path, response.text)
            assert int(response.headers["retry-after"]) > 0
            assert response.json()["error"]["type"] == "service_unavailable"


def test_an_unreachable_redis_is_a_503_with_retry_after(api_checkpoint):
    with fresh_pg_database() as url:
        migrate.upgrade(url)
        config = stack_config(api_checkpoint, url).replace("queue", broker_url="redis://127.0.0.1:9/0")
        app = create_app(config, admin_key="admin-key", served=ServedModel.load(config.model, config.sampling))
        with TestClient(app) as client:
            response = client.get("/metrics")
    assert response.status_code == 503 and int(response.headers["retry-after"]) > 0, response.text
    assert "Redis" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def pg_client(api_checkpoint):
    with fresh_pg_database() as url:
        migrate.upgrade(url)
        with app_on(api_checkpoint, url) as client:
            yield client


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "before\u0000after"}, "prompt"),
        ({"messages": [{"role": "user", "content": "a\u0000b"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\u0000"}]}]}, "messages[0].content"),
        ({"prompt": "x", "custom_id": "id\u0000"}, "custom_id"),
    ],
)
def test_a_nul_character_in_a_text_field_is_a_400_naming_it(pg_client, body, field):
    response = pg_client.post("/v1/jobs", json=body, headers=ADMIN)
    assert response.status_code == 400, response.text
    assert f"{field} contains a NUL character" in response.json()["error"]["message"]


def test_a_nul_character_in_an_id_is_a_4xx_not_a_500(pg_client):
    for path in ("/v1/files/file-%00", "/v1/files/a%00/content", "/v1/batches/%00"):
        assert pg_client.get(path, headers=ADMIN).status_code in (400, 404), path
    created = pg_client.post(
        "/v1/batches",
        headers=ADMIN,
        json={"input_file_id": "file-\u0000", "endpoint": "/v1/completions", "completion_window": "24h"},
    )
    assert created.status_code in (400, 404), created.text
    assert pg_client.get("/v1/files", params={"after": "x\u0000"}, headers=ADMIN).status_code in (400, 404)
