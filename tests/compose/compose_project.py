"""docker-compose.yml run by `docker compose` (the v2 CLI plugin) on the private engine, under a
project name of its own and a free host port for the API, as a user would run it.

The settings a user would export in their shell (TOKENLOOM_API_KEY, API_HOST_PORT, ...) are the
only differences from the file's defaults, and they go through the compose file's own `${...}`
variables: the file itself is not modified.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.compose.docker_engine import DockerEngine

REPO_ROOT = Path(__file__).resolve().parents[2]


class DeadlinePassed(AssertionError):
    pass


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5, log=lambda: ""):
    """Poll `predicate` until it returns something true; fail with `what` (and a log) at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise DeadlinePassed(f"timed out after {timeout_s:.0f} s waiting for {what}\n{log()[-4000:]}")
        time.sleep(poll_s)
    return value


@dataclass
class ComposeProject:
    engine: DockerEngine
    name: str
    shell: dict[str, str] = field(default_factory=dict)  # what the user exported before `docker compose`
    files: tuple[Path, ...] = (REPO_ROOT / "docker-compose.yml",)

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        file_args = [arg for path in self.files for arg in ("-f", str(path))]
        return self.engine.docker(
            "compose",
            "--project-name",
            self.name,
            *file_args,
            *args,
            timeout_s=timeout_s,
            check=check,
            env=self.engine.env(**self.shell),
            cwd=REPO_ROOT,
        )

    def container(self, service: str) -> str:
        ids = self.compose("ps", "--all", "--quiet", service).stdout.split()
        assert len(ids) == 1, f"{service}: expected one container, found {ids}"
        return ids[0]

    def state(self, service: str) -> dict:
        """The container's State (Status, Health, StartedAt, ...) as `docker inspect` reports it."""
        inspected = json.loads(self.engine.docker("inspect", self.container(service)).stdout)
        return inspected[0]["State"]

    def health(self, service: str) -> str | None:
        return (self.state(service).get("Health") or {}).get("Status")

    def logs(self, *services: str) -> str:
        done = self.compose("logs", "--no-color", "--tail", "80", *services, check=False, timeout_s=60)
        return done.stdout + done.stderr

    def down(self) -> subprocess.CompletedProcess[str]:
        """Every service of every profile, with the project's volumes and network."""
        return self.compose(
            "--profile", "*", "down", "--volumes", "--remove-orphans", "--timeout", "10", check=False, timeout_s=300
        )
