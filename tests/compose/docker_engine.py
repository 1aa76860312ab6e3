"""A private Docker engine for the compose test: `dockerd` on its own socket, started by the test
and stopped by its PID, with the host's networking put back as it was.

Why private: the test must neither need nor disturb a Docker the machine may already run. The data
root lives in the cache folder (CACHE_DIR), not under /tmp, so image layers and BuildKit's cache
outlive the session and a warm run rebuilds nothing; socket, exec root and pidfile are the
session's own. A lock file keeps two sessions off one data root.

dockerd changes host networking when it starts (a docker0 bridge, DOCKER iptables chains, the
FORWARD policy DROP, ip_forward=1); stop() restores the iptables tables, ip_forward and the links
as they were before start().
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenloom-compose"
START_TIMEOUT_S = 60  # dockerd is ready in ~2 s here; this bounds a broken start
STOP_TIMEOUT_S = 60  # dockerd stops its containers first (each within its own stop timeout)
LOCK_TIMEOUT_S = 1800  # another session's compose test on this data root: wait for it, within reason
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
IPTABLES_TABLES = ("filter", "nat")  # the tables dockerd writes to


class EngineUnavailable(RuntimeError):
    """No container engine can start here; the message says why (the test skips with it)."""


def docker_client() -> str:
    """Debian's `docker` (package docker.io) when present: its `docker build` runs BuildKit inside
    the daemon without the buildx plugin, and BuildKit builds only the stages the target needs
    (the classic builder would also build the Dockerfile's install-cuda stage). Else PATH's."""
    debian = Path("/usr/bin/docker")
    found = str(debian) if debian.is_file() else shutil.which("docker")
    if found is None:
        raise EngineUnavailable("no `docker` client (Debian: apt-get install docker.io)")
    return found


@dataclass
class HostNetwork:
    """What dockerd changes on the host, captured before it starts."""

    iptables: dict[str, str]  # table -> iptables-save output
    ip_forward: str
    links: set[str]

    @classmethod
    def capture(cls) -> HostNetwork:
        tables = {table: _run(["iptables-save", "-t", table]).stdout for table in IPTABLES_TABLES}
        return cls(tables, IP_FORWARD.read_text().strip(), _links())

    def restore(self) -> None:
        for table, saved in self.iptables.items():
            if saved.strip():
                subprocess.run(["iptables-restore", "-T", table], input=saved, text=True, check=True)
            else:  # the table held nothing before: empty it again
                _run(["iptables", "-t", table, "-F"])
                _run(["iptables", "-t", table, "-X"])
        IP_FORWARD.write_text(self.ip_forward + "\n")
        for link in sorted(_links() - self.links):  # docker0, br-<network id>, leftover veths
            _run(["ip", "link", "delete", link])


@dataclass
class DockerEngine:
    data_root: Path
    run_dir: Path
    client: str
    compose_plugin: Path  # the Docker Compose v2 binary, installed as the CLI's `compose` plugin
    process: subprocess.Popen | None = None
    network: HostNetwork | None = None
    _lock: IO[str] | None = field(default=None, repr=False)

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "dockerd.log"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every docker command: this engine, BuildKit, the compose plugin, and
        nothing of the caller's shell that docker or compose would read (DOCKER_*, TOKENLOOM_*,
        HF_TOKEN, MODELS_DIR...): the compose file's defaults are what gets tested."""
        base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
        return {
            **base,
            "DOCKER_HOST": f"unix://{self.socket}",
            "DOCKER_CONFIG": str(self.run_dir / "config"),
            "DOCKER_BUILDKIT": "1",
            **extra,
        }

    def docker(
        self,
        *args: str,
        timeout_s: float = 600,
        check: bool = True,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.client, *args], env=env or self.env(), cwd=cwd, capture_output=True, text=True, timeout=timeout_s
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
        return done

    def start(self) -> None:
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise EngineUnavailable("no `dockerd` (Debian: apt-get install docker.io)")
        if os.geteuid() != 0:
            raise EngineUnavailable("dockerd needs root (this test starts its own engine)")
        self._take_lock()
        plugins = self.run_dir / "config" / "cli-plugins"
        plugins.mkdir(parents=True)
        (plugins / "docker-compose").symlink_to(self.compose_plugin)
        self.network = HostNetwork.capture()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [
                    dockerd,
                    "--data-root",
                    str(self.data_root),
                    "--exec-root",
                    str(self.run_dir / "exec"),
                    "--pidfile",
                    str(self.run_dir / "dockerd.pid"),
                    "-H",
                    f"unix://{self.socket}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.docker("version", "--format", "{{.Server.Version}}", check=False, timeout_s=30).returncode:
            if self.process.poll() is not None or time.monotonic() > deadline:
                reason = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                self.stop()
                raise EngineUnavailable("dockerd did not start: " + " | ".join(reason))
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop dockerd by its PID (its containerd and containers go with it), then undo its
        changes to host networking, then free the data root for the next session."""
        try:
            if self.process is not None and self.process.poll() is None:
                os.kill(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.kill(self.process.pid, signal.SIGKILL)
                    self.process.wait(10)
            if self.network is not None:
                self.network.restore()
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self._lock is not None:
                self._lock.close()  # releases the flock

    def _take_lock(self) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.data_root.parent / "engine.lock", "w")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"{self.data_root} stayed locked by another session") from None
                time.sleep(1)


def private_engine(compose_plugin: Path) -> DockerEngine:
    run_dir = Path(tempfile.mkdtemp(prefix="tl-dockerd-"))  # short: a unix socket path has a length limit
    return DockerEngine(CACHE_DIR / "docker-data", run_dir, docker_client(), compose_plugin)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _links() -> set[str]:
    out = _run(["ip", "-o", "link", "show"]).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}
