"""`tokenloom serve` as its own process, so a test can SIGKILL it and start it again on the same
port (the in-thread uvicorn of tests/api cannot be killed mid-stream).

Its output goes to a log file that the key-leak checks read (tests/reliability/test_hostile_input.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.services import REPO_ROOT

API_START_TIMEOUT_S = 60


class ApiProcess:
    def __init__(self, settings: dict[str, str], port: int, log_path: Path):
        self.env = {**os.environ, **settings, "PYTHONPATH": str(REPO_ROOT)}
        self.port = port
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start and wait for /healthz; returns the seconds it took."""
        started = time.monotonic()
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tokenloom.cli",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "info",
                ],
                env=self.env,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = started + API_START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tokenloom serve did not come up:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
