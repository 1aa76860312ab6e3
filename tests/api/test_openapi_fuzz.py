"""Property-based run over the OpenAPI document (schemathesis + hypothesis) against a real API
(uvicorn on loopback, Postgres, Redis, the session's worker), as the admin: no generated request
may get a 5xx.

Bounded to well under a minute: a fixed number of examples per operation, derandomized (the same
run every time), and an API instance of its own whose max_model_len is small, so no generated
completion can ask the worker for more than a few dozen tokens per choice. Admission control
([server] max_queued_jobs) caps the jobs it can queue; whatever is still open is cancelled after.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.api.conftest import ThreadedServer, free_port, stack_config
from tokenloom.api.app import create_app

MAX_EXAMPLES = 10
FUZZ_MAX_MODEL_LEN = 24

schema = schemathesis.pytest.from_fixture("openapi_schema")


@pytest.fixture(scope="module")
def fuzz_api(stack):
    config = stack_config(stack.checkpoint, stack.db_url).replace("model", max_model_len=FUZZ_MAX_MODEL_LEN)
    port = free_port()
    with ThreadedServer(create_app(config, admin_key=stack.admin_key), port):
        yield f"http://127.0.0.1:{port}"
    with stack.client() as client:  # leave no fuzz jobs running for the tests after this one
        for status in ("queued", "running"):
            for job in client.get("/v1/jobs", params={"status": status, "limit": 1000}).json()["data"]:
                client.post(f"/v1/jobs/{job['id']}/cancel")


# Every operation gets schemathesis' coverage phase (boundary and just-invalid values of each field)
# plus MAX_EXAMPLES fuzzed cases, except the three that queue real jobs: their coverage phase alone
# is a hundred completions, so they get the fuzzed cases only.
CONFIG = {
    "seed": 20261202,
    "generation": {"max-examples": MAX_EXAMPLES},
    "operations": [
        {"include-path-regex": "^/v1/(chat/)?completions$|^/v1/jobs$", "phases": {"coverage": {"enabled": False}}}
    ],
}


@pytest.fixture(scope="module")
def openapi_schema(fuzz_api):
    return schemathesis.openapi.from_url(f"{fuzz_api}/openapi.json", config=schemathesis.Config.from_dict(CONFIG))


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_server_error(case, stack):
    response = case.call(headers={"Authorization": f"Bearer {stack.admin_key}"}, timeout=60)
    allowed = {503} if case.path == "/readyz" else set()  # a probe may say "not ready"
    assert response.status_code < 500 or response.status_code in allowed, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:1000]}\n{case.as_curl_command()}"
    )
