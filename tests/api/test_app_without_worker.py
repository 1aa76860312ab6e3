"""The app with no worker and no keys (an open API) on a SQLite database, through FastAPI's TestClient:
request errors, the open-API warning and readiness. Nothing here needs a job to run."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import stack_config
from tests.conftest import ORACLE_CONFIG
from tokenloom.api.app import create_app
from tokenloom.api.served_model import ServedModel
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.store import migrate


@pytest.fixture(scope="module")
def no_template_checkpoint(tmp_path_factory):
    path = build_random_checkpoint(tmp_path_factory.mktemp("plain") / "plain-llama", **ORACLE_CONFIG)
    (path / "chat_template.jinja").unlink()  # a base model: no chat template
    return path


@pytest.fixture(scope="module")
def client(no_template_checkpoint, tmp_path_factory, caplog_module):
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'api.db'}"
    migrate.upgrade(url)
    config = stack_config(no_template_checkpoint, url)
    app = create_app(config, served=ServedModel.load(config.model, config.sampling))
    with TestClient(app) as test_client:  # runs the lifespan (start-up warning)
        yield test_client


@pytest.fixture(scope="module")
def caplog_module():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tokenloom.api")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_with_no_key_configured_the_api_is_open_and_says_so_loudly(client, caplog_module):
    assert client.get("/v1/models").status_code == 200
    warnings = [r.getMessage() for r in caplog_module if r.levelno == logging.WARNING]
    assert any("the API is OPEN" in w and "TOKENLOOM_API_KEY" in w for w in warnings)


def test_chat_on_a_model_without_a_template_says_how_to_set_one(client):
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400
    assert "[model] chat_template" in reply.json()["error"]["message"]


def test_route_and_method_errors_use_the_openai_error_shape(client):
    missing = client.get("/v1/nothing")
    wrong_method = client.delete("/v1/models")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert wrong_method.status_code == 405 and "DELETE" in wrong_method.json()["error"]["message"]


def test_validation_errors_become_422s_naming_each_field(client):
    reply = client.post("/v1/completions", json={"prompt": "hi", "n": 0, "top_p": 2, "stream": "yes"})
    assert reply.status_code == 422
    message = reply.json()["error"]["message"]
    assert "'n'" in message and "'top_p'" in message and "'stream'" in message
    assert reply.json()["error"]["param"] == "top_p"  # the first bad field, in declaration order


def test_a_declared_body_over_the_limit_is_refused_before_reading(client):
    reply = client.post(
        "/v1/completions", content=b"{}", headers={"content-length": str(5 * 2**20), "content-type": "application/json"}
    )
    assert reply.status_code == 413 and "max_body_mb" in reply.json()["error"]["message"]


def test_readyz_names_what_is_missing(client):
    reply = client.get("/readyz")
    assert reply.status_code == 503
    assert reply.json()["checks"]["database"] == "ok"
    assert "tokenloom worker" in reply.json()["checks"]["worker"]
    assert "not ready" in reply.json()["error"]["message"]


def test_served_name_is_what_clients_call_the_model(no_template_checkpoint, tmp_path):
    # The seed's client sends "model": "your-model-name"; [model] served_name makes that work unchanged.
    url = f"sqlite:///{tmp_path / 'alias.db'}"
    migrate.upgrade(url)
    config = stack_config(no_template_checkpoint, url).replace("model", served_name="your-model-name")
    app = create_app(config, served=ServedModel.load(config.model, config.sampling))
    with TestClient(app) as alias_client:
        assert [m["id"] for m in alias_client.get("/v1/models").json()["data"]] == ["your-model-name"]
        assert alias_client.get("/v1/models/your-model-name").status_code == 200
        unknown = alias_client.get("/v1/models/some-other-model")
        assert unknown.status_code == 404 and "'your-model-name'" in unknown.json()["error"]["message"]


def test_token_id_prompts_are_checked_against_the_models_vocabulary(tmp_path):
    # bench-135m style: the model's vocabulary (1000) is larger than its tokenizer's (384).
    checkpoint = build_random_checkpoint(tmp_path / "wide-vocab", vocab_size=1000, **ORACLE_CONFIG)
    url = f"sqlite:///{tmp_path / 'vocab.db'}"
    migrate.upgrade(url)
    config = stack_config(checkpoint, url)
    served = ServedModel.load(config.model, config.sampling)
    assert served.encode([0, 500, 999], None) == [0, 500, 999]
    with pytest.raises(Exception, match=r"\[0, 1000\)"):
        served.encode([1000], None)
