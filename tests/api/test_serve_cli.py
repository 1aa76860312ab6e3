"""`tokenloom serve` as a user runs it: a subprocess reading config from TOKENLOOM_* variables and the
admin key from the env var that [server] api_key_env names."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tests.api.conftest import free_port
from tests.services import REPO_ROOT
from tokenloom.store import migrate


def test_serve_binds_the_port_and_reads_the_admin_key_from_the_named_env_var(api_checkpoint, tmp_path):
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    migrate.upgrade(url)
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "TOKENLOOM_DATABASE_URL": url,
        "TOKENLOOM_MODEL_NAME": str(api_checkpoint),
        "TOKENLOOM_SERVER_API_KEY_ENV": "MY_ADMIN_KEY",
        "MY_ADMIN_KEY": "s3cret",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenloom.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
                break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
                time.sleep(0.2)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        models = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer s3cret"}).json()
        assert models["data"][0]["id"] == str(api_checkpoint)
    finally:
        server.terminate()
        server.wait(20)
