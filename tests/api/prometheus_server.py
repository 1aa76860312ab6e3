"""A real Prometheus (Debian's `prometheus` package) scraping the local compose stack with the
repository's monitoring/prometheus.yml: only the target (the API's free port instead of
`api:8000`), the scrape interval (1 s, so a test waits seconds, not minutes) and the storage
directory differ from the file.

Without the binary the tests that need it skip and say why; CI (.ci/run) installs it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.compose_stack import LocalComposeStack, free_port, wait_for
from tests.services import REPO_ROOT

PROMETHEUS_CONFIG = REPO_ROOT / "monitoring" / "prometheus.yml"
SCRAPE_INTERVAL = "1s"


@dataclass
class PrometheusServer:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def query(self, expr: str) -> dict:
        """The HTTP API's answer to an instant query (status, data or error)."""
        return httpx.get(f"{self.base_url}/api/v1/query", params={"query": expr}, timeout=10).json()

    def metric_names(self) -> set[str]:
        return set(httpx.get(f"{self.base_url}/api/v1/label/__name__/values", timeout=10).json()["data"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


def scrape_config_for(stack: LocalComposeStack) -> dict:
    """monitoring/prometheus.yml with the test's target and a short interval."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    [job] = config["scrape_configs"]
    [static] = job["static_configs"]
    assert static["targets"] == ["api:8000"], static  # the compose service the file names
    static["targets"] = [f"127.0.0.1:{stack.api_port}"]
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = SCRAPE_INTERVAL
    return config


def start_prometheus(stack: LocalComposeStack, workdir: Path) -> PrometheusServer:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus; .ci/run does)")
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(scrape_config_for(stack)))
    port = free_port()
    log_path = workdir / "prometheus.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
    server = PrometheusServer(f"http://127.0.0.1:{port}", process, log_path)

    def ready() -> bool:
        if process.poll() is not None:
            pytest.fail(f"prometheus exited:\n{server.log()[-3000:]}")
        try:
            return httpx.get(f"{server.base_url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(ready, 60, "prometheus to be ready", log=server.log)
    return server
