"""What the Dockerfile's install-cuda stage would install, found without installing it: run inside
that stage's parent (the `base` stage: Python, the sources, nothing installed) as
`python cuda_torch_probe.py '<the stage's pip install command>'`; prints one JSON object.

1. pip resolves the stage's exact command with `--dry-run --report` (metadata only: PyPI serves
   each wheel's METADATA apart, PEP 658);
2. torch/version.py, the module behind `torch.version.cuda`, is read out of the torch wheel pip
   chose through HTTP range requests (the zip's directory and one member: well under 1% of the
   wheel), so the CUDA check needs no download of the wheel, let alone of the CUDA libraries;
3. the wheels' sizes come from HEAD requests: the variant's download size, for the docs.

Standard library only: it runs where nothing is installed.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TIMEOUT_S = 60


class RemoteFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests: enough for zipfile."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.size = content_length(url)
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        end = min(self.position + len(buffer), self.size) - 1
        if end < self.position:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-{end}"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            assert response.status == 206, f"{self.url} does not serve byte ranges"
            data = response.read()
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def content_length(url: str) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=TIMEOUT_S) as response:
        return int(response.headers["Content-Length"])


def resolve(install_command: str) -> list[dict]:
    """The `install` list of pip's report for the command, as a dry run."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(f"{install_command} --dry-run --quiet --report {report}", shell=True, check=True)
        return json.loads(report.read_text())["install"]


def torch_version_module(wheel_url: str) -> dict[str, object]:
    """The constants of torch/version.py in the remote wheel (`cuda`, `__version__`, ...)."""
    with zipfile.ZipFile(RemoteFile(wheel_url)) as wheel:
        source = wheel.read("torch/version.py").decode()
    constants: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            constants.update({t.id: node.value.value for t in targets if isinstance(t, ast.Name)})
    return constants


def main(install_command: str) -> None:
    installs = resolve(install_command)
    [torch] = [item for item in installs if item["metadata"]["name"].lower() == "torch"]
    url = torch["download_info"]["url"]
    urls = [item["download_info"]["url"] for item in installs if item["download_info"]["url"].startswith("http")]
    with ThreadPoolExecutor(8) as pool:
        download_bytes = sum(pool.map(content_length, urls))
    requires = torch["metadata"].get("requires_dist") or []
    print(
        json.dumps(
            {
                "torch_url": url,
                "torch_version": torch["metadata"]["version"],
                "torch_version_py": torch_version_module(url),
                "nvidia_requirements": sorted(
                    r.split(";")[0].strip() for r in requires if r.lower().startswith("nvidia")
                ),
                "num_packages": len(installs),
                "download_mb": round(download_bytes / 1e6),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
