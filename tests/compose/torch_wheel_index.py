"""Where the tokenloom:cpu build gets CPU torch when PyTorch's CPU index is out of reach.

The Dockerfile's install-cpu stage takes PyTorch's CPU wheel index from the build argument
TORCH_CPU_INDEX (its default is PyTorch's own page, what a user's machine reaches). Where that
page does not resolve, as here, the test serves the same wheel from this machine's disk: pip on
the host is configured to find it (a find-links folder), so `pip download` copies it into the
cache, and a one-package index on 127.0.0.1 serves it to the build. 127.0.0.1 because pip only
trusts plain HTTP there; the build therefore runs with `--network host` (see the conftest).
"""

from __future__ import annotations

import functools
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.compose.docker_engine import CACHE_DIR

PYTORCH_CPU_HOST = "download.pytorch.org"
INDEX_DIR = CACHE_DIR / "torch-index"  # INDEX_DIR/torch/<wheel>: the index's one project page
PIP_TIMEOUT_S = 600
# A fixed port where it is free: the build argument's value is part of the pip layer's cache key,
# so a new port each run would reinstall every dependency on a warm run.
PREFERRED_PORT = 47613


def locked_cpu_torch(lock: Path) -> str:
    """The torch version of requirements/cpu.lock, e.g. 2.13.0+cpu."""
    match = re.search(r"^torch==(\S+)$", lock.read_text(), re.MULTILINE)
    assert match, f"{lock} pins no torch"
    return match.group(1)


def pytorch_index_reachable() -> bool:
    try:
        socket.create_connection((PYTORCH_CPU_HOST, 443), timeout=5).close()
        return True
    except OSError:
        return False


def cached_wheel(version: str) -> Path:
    """The linux x86_64, CPython 3.11 wheel of torch==version, fetched once with the host's pip."""
    project = INDEX_DIR / "torch"
    wheels = sorted(project.glob(f"torch-{version}-cp311-cp311-*linux*_x86_64.whl"))
    if wheels:
        return wheels[0]
    project.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_28_x86_64",
            "--quiet",
            "--dest",
            str(project),
            f"torch=={version}",
        ],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    wheels = sorted(project.glob(f"torch-{version}-cp311-cp311-*linux*_x86_64.whl"))
    assert done.returncode == 0 and wheels, (
        f"{PYTORCH_CPU_HOST} is unreachable and pip found no torch=={version} wheel elsewhere (a find-links "
        f"folder or an index in pip's configuration): {done.stderr.strip()[-1500:]}"
    )
    return wheels[0]


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        """pip asks for every package it resolves; the 404s of all but torch are expected."""


@contextmanager
def cpu_torch_index(lock: Path) -> Iterator[str | None]:
    """The TORCH_CPU_INDEX build argument to pass, or None for the Dockerfile's default."""
    if pytorch_index_reachable():
        yield None
        return
    cached_wheel(locked_cpu_torch(lock))
    handler = functools.partial(_QuietHandler, directory=str(INDEX_DIR))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", PREFERRED_PORT), handler)
    except OSError:  # taken: any port works, at the cost of that one rebuild
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
