"""Local stand-ins for the registry images docker-compose.yml names (python:3.11-slim, postgres:16,
redis:7), built from a debootstrapped Debian bookworm, since no image registry is reachable where
the compose test runs. Each carries the name the compose file uses, so the file runs unchanged:
compose pulls only images that are missing.

The debootstrapped tree is cached as a tarball in CACHE_DIR (about a minute to make, 120 MB), the
images and their build cache in the engine's data root there too, so a warm run only confirms the
layers. The Dockerfiles are in images/: what each stand-in keeps of its official image is what the
compose services rely on (entrypoints, environment, volumes, healthcheck commands).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.compose.docker_engine import CACHE_DIR, DockerEngine

IMAGES_DIR = Path(__file__).resolve().parent / "images"
TARBALL = CACHE_DIR / "debian-bookworm-minbase.tar"
MINBASE_IMAGE = "local/debian-minbase:bookworm"
DEBIAN_IMAGE = "local/debian:bookworm"
STAND_INS = {"python:3.11-slim": "python", "postgres:16": "postgres", "redis:7": "redis"}  # tag -> images/<dir>
DEBOOTSTRAP_TIMEOUT_S = 900
DEFAULT_MIRROR = "http://deb.debian.org/debian"
HOST_AUTHORITIES = Path("/usr/local/share/ca-certificates")


def debian_mirror() -> str:
    """The Debian mirror apt already uses here (the first bookworm `deb`/`URIs:` source that is not
    the security archive), so debootstrap goes where this machine's apt is allowed to go."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in (p for p in sources if p.is_file()):
        for url in re.findall(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|^URIs:\s*)(\S+)", path.read_text(), re.MULTILINE):
            if "security" not in url:
                return url
    return DEFAULT_MIRROR


def ensure_tarball() -> Path:
    """The debootstrapped bookworm (minbase) as a tarball in the cache; made once per machine."""
    if TARBALL.is_file():
        return TARBALL
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise AssertionError("debootstrap is needed to make the base image: apt-get install debootstrap")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        rootfs = Path(tmp) / "rootfs"
        done = subprocess.run(
            [debootstrap, "--variant=minbase", "bookworm", str(rootfs), debian_mirror()],
            capture_output=True,
            text=True,
            timeout=DEBOOTSTRAP_TIMEOUT_S,
        )
        assert done.returncode == 0, f"debootstrap failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        # Package scripts must not start services during image builds (there is no init).
        policy = rootfs / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        for cached in [*(rootfs / "var/cache/apt/archives").glob("*.deb"), *(rootfs / "var/lib/apt/lists").glob("*_*")]:
            cached.unlink()
        partial = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True, timeout=300)
        os.replace(partial, TARBALL)  # whole or absent: an interrupted run leaves no half tarball
    return TARBALL


def has_image(engine: DockerEngine, tag: str) -> bool:
    return engine.docker("image", "inspect", tag, check=False).returncode == 0


def build_debian_base(engine: DockerEngine) -> None:
    """local/debian:bookworm: the imported tarball plus the host's own certificate authorities.

    The authorities are added per run, not baked into the cached tarball: a machine's proxy
    authority can change between sessions, and BuildKit rebuilds what depends on it when it does."""
    if not has_image(engine, MINBASE_IMAGE):
        engine.docker("import", str(ensure_tarball()), MINBASE_IMAGE, timeout_s=300)
    with tempfile.TemporaryDirectory() as context:
        shutil.copy(IMAGES_DIR / "debian" / "Dockerfile", context)
        authorities = Path(context) / "ca-certificates"
        authorities.mkdir()
        for crt in HOST_AUTHORITIES.glob("*.crt") if HOST_AUTHORITIES.is_dir() else ():
            shutil.copy(crt, authorities)
        engine.docker("build", "--quiet", "--tag", DEBIAN_IMAGE, context)


def build_stand_ins(engine: DockerEngine) -> None:
    build_debian_base(engine)
    for tag, directory in STAND_INS.items():
        engine.docker("build", "--quiet", "--tag", tag, str(IMAGES_DIR / directory), timeout_s=900)
