"""Keys: a project's key cannot reach another project's jobs, files or batches through any
endpoint (404, as if they did not exist); a revoked key stops working at once; no key ever shows up
in a response (after `create_key` printed it) or in the API's and worker's logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.services import REPO_ROOT
from tokenloom.store.api_keys.key_queries import create_key, revoke_key

URL = "/v1/completions"
SEEN: list[str] = []  # every response of this module, headers and body, for the leak check


def _record(response: httpx.Response) -> None:
    response.read()
    SEEN.append(json.dumps(dict(response.headers)) + response.text)


def client(stack, key: str) -> httpx.Client:
    return stack.client(key, event_hooks={"response": [_record]})


@pytest.fixture(scope="module")
def lab_a_objects(api_stack):
    """A job, an input file, a finished batch with its output file: all lab-a's."""
    batch_line = {
        "custom_id": "a1",
        "method": "POST",
        "url": URL,
        "body": {"prompt": "lab-a only", "max_tokens": 4, "temperature": 0.0},
    }
    with client(api_stack, api_stack.keys["lab-a"]) as lab_a:
        job = lab_a.post("/v1/jobs", json={"prompt": "lab-a only", "max_tokens": 4}).json()["ids"][0]
        file_id = lab_a.post(
            "/v1/files", files={"file": ("a.jsonl", json.dumps(batch_line).encode())}, data={"purpose": "batch"}
        ).json()["id"]
        batch = lab_a.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": URL, "completion_window": "24h"}
        ).json()["id"]
        deadline = time.monotonic() + 60
        while (found := lab_a.get(f"/v1/batches/{batch}").json())["status"] != "completed":
            assert time.monotonic() < deadline, found
            time.sleep(0.2)
        open_batch = lab_a.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": URL, "completion_window": "24h"}
        ).json()["id"]
    return {"job": job, "file": file_id, "batch": batch, "output": found["output_file_id"], "open_batch": open_batch}


def _foreign_requests(ids: dict) -> list[tuple[str, str, dict]]:
    return [
        ("GET", f"/v1/jobs/{ids['job']}", {}),
        ("POST", f"/v1/jobs/{ids['job']}/cancel", {}),
        ("GET", f"/v1/files/{ids['file']}", {}),
        ("GET", f"/v1/files/{ids['file']}/content", {}),
        ("GET", f"/v1/files/{ids['output']}", {}),
        ("GET", f"/v1/files/{ids['output']}/content", {}),
        ("GET", f"/v1/batches/{ids['batch']}", {}),
        ("POST", f"/v1/batches/{ids['batch']}/cancel", {}),
        ("POST", f"/v1/batches/{ids['open_batch']}/cancel", {}),
        ("POST", "/v1/batches", {"json": {"input_file_id": ids["file"], "endpoint": URL, "completion_window": "24h"}}),
        ("GET", "/v1/jobs", {"params": {"after": ids["job"]}}),
        ("GET", "/v1/batches", {"params": {"after": ids["batch"]}}),
        ("GET", "/v1/files", {"params": {"after": ids["file"]}}),
    ]


def test_another_projects_ids_are_404_on_every_endpoint(api_stack, lab_a_objects):
    with client(api_stack, api_stack.keys["lab-b"]) as lab_b:
        answers = [
            (method, path, lab_b.request(method, path, **kw)) for method, path, kw in _foreign_requests(lab_a_objects)
        ]
        listed = [
            lab_b.get(path, params=params)
            for path, params in (
                ("/v1/jobs", {"limit": 1000}),
                ("/v1/files", {"limit": 10000}),
                ("/v1/batches", {"limit": 100}),
                ("/v1/jobs", {"batch_id": lab_a_objects["batch"]}),
            )
        ]
    wrong = [(m, p, r.status_code) for m, p, r in answers if r.status_code != 404]
    assert not wrong, wrong
    for response in listed:
        assert response.status_code in (200, 404), response.text[:300]
        assert not any(object_id in response.text for object_id in lab_a_objects.values()), response.text[:500]
    with client(api_stack, api_stack.keys["lab-a"]) as lab_a:  # the owner still sees them all
        assert lab_a.get(f"/v1/jobs/{lab_a_objects['job']}").status_code == 200
        assert lab_a.get(f"/v1/files/{lab_a_objects['output']}/content").status_code == 200
        assert lab_a.get(f"/v1/batches/{lab_a_objects['open_batch']}").status_code == 200


def test_a_revoked_key_stops_working_at_once(api_stack, lab_a_objects):
    key, info = create_key(api_stack.sessions, "lab-a", "short-lived")
    api_stack.keys["lab-a-revoked"] = key  # checked by the leak test below
    with client(api_stack, key) as temp:
        assert temp.get(f"/v1/jobs/{lab_a_objects['job']}").status_code == 200
        revoke_key(api_stack.sessions, info.key_prefix)
        after = [
            temp.get(f"/v1/jobs/{lab_a_objects['job']}"),
            temp.post("/v1/jobs", json={"prompt": "x"}),
            temp.get("/v1/files"),
            temp.get("/v1/batches"),
            temp.post(URL, json={"prompt": "x", "max_tokens": 2}),
        ]
    assert [r.status_code for r in after] == [403] * len(after)
    assert all(r.json()["error"]["code"] == "key_revoked" for r in after)


def test_keys_never_appear_in_responses_or_logs(api_stack, lab_a_objects):
    with client(api_stack, api_stack.keys["lab-a"]) as lab_a:  # a few more answers, errors included
        lab_a.get("/v1/models")
        lab_a.get("/v1/stats")
        lab_a.post("/v1/jobs", json={"prompt": 5})
    with client(api_stack, "tlk-not-a-real-key-" + api_stack.keys["lab-b"][::-1]) as wrong:
        wrong.get("/v1/jobs")
    listing = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "keys", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**os.environ, **api_stack.worker.env, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert listing.returncode == 0, listing.stderr
    texts = {
        "responses": "\n".join(SEEN),
        "api log": api_stack.api.log(),
        "worker log": api_stack.worker.log(),
        "keys list": listing.stdout + listing.stderr,
    }
    assert len(SEEN) > 20 and "POST /v1/jobs" in texts["api log"]  # the check saw real traffic
    leaks = [(where, secret[:8]) for secret in api_stack.secrets for where, text in texts.items() if secret in text]
    assert not leaks, f"keys found in: {leaks}"
