"""GET /health (vLLM's name for /healthz) and GET /version, against the real stack (keys enforced)."""

from __future__ import annotations

from importlib.metadata import version

import httpx

from tests.api.conftest import MAX_MODEL_LEN


def test_health_answers_like_healthz_without_a_key(stack):
    with stack.client(key=None) as client:
        health, healthz = client.get("/health"), client.get("/healthz")
    assert health.status_code == healthz.status_code == 200
    assert health.json() == healthz.json() == {"status": "ok"}


def test_version_without_a_valid_key_is_the_package_version_only(stack):
    with stack.client(key=None) as anonymous, stack.client(key="tl-not-a-key") as wrong:
        replies = [anonymous.get("/version"), wrong.get("/version")]
    assert [r.status_code for r in replies] == [200, 200]
    assert [r.json() for r in replies] == [{"version": version("tokenloom")}] * 2


def test_version_with_a_project_key_names_the_served_model(stack):
    with stack.client(stack.project_keys["lab-a"]) as client:
        info = client.get("/version").json()
        models = client.get("/v1/models").json()["data"]
    assert info == {"version": version("tokenloom"), "model": models[0]["id"], "max_model_len": MAX_MODEL_LEN}
    assert info["model"] == stack.model


def test_health_and_version_are_in_the_openapi_document(stack):
    paths = httpx.get(f"{stack.base_url}/openapi.json").json()["paths"]
    assert {"/health", "/healthz", "/version"} <= set(paths)
