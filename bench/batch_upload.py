"""A 50,000-line batch through the API: upload wall time, batch-create wall time (rows inserted per
second) and, for the caller, the API process's peak RSS (`peak_rss_mb`, Linux VmHWM).

    from bench.batch_upload import peak_rss_mb, run
    before = peak_rss_mb(api_pid)
    figures = run("http://127.0.0.1:8000", api_key)
    after = peak_rss_mb(api_pid)

The file holds short chat requests (max_tokens 1) for the server's model (GET /v1/models). The
body is streamed from a temporary file, so the client's memory does not blur the picture. The
batch is created, not waited for. Not a test: compare figures of one machine, not across machines.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

CHAT_URL = "/v1/chat/completions"
UPLOAD_READ_BYTES = 1 << 20


def write_batch_file(path: Path, model: str, lines: int) -> int:
    """`lines` short chat requests; returns the file's size in bytes."""
    with open(path, "w", encoding="utf-8") as out:
        for i in range(lines):
            out.write(
                json.dumps(
                    {
                        "custom_id": f"req-{i}",
                        "method": "POST",
                        "url": CHAT_URL,
                        "body": {
                            "model": model,
                            "max_tokens": 1,
                            "temperature": 0,
                            "messages": [{"role": "user", "content": f"Classify request {i}: positive or negative?"}],
                        },
                    }
                )
                + "\n"
            )
    return path.stat().st_size


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size so far (VmHWM in /proc/<pid>/status), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM line: not a Linux process?")


def _multipart_body(path: Path, boundary: str) -> Iterator[bytes]:
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    with open(path, "rb") as src:
        while data := src.read(UPLOAD_READ_BYTES):
            yield data
    yield f"\r\n--{boundary}--\r\n".encode()


def run(api_base: str, api_key: str | None, lines: int = 50_000) -> dict:
    """Upload a `lines`-line batch file and create its batch; returns the timings (seconds)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with (
        httpx.Client(base_url=api_base, headers=headers, timeout=600) as client,
        tempfile.TemporaryDirectory() as workdir,
    ):
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        path = Path(workdir) / f"batch-{lines}.jsonl"
        file_bytes = write_batch_file(path, model, lines)
        boundary = "tokenloom-bench-boundary"
        start = time.perf_counter()
        # A generator body is sent chunked; the server's multipart parser spools it to disk.
        uploaded = client.post(
            "/v1/files",
            content=_multipart_body(path, boundary),
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
        upload_s = time.perf_counter() - start
        uploaded.raise_for_status()
        start = time.perf_counter()
        created = client.post(
            "/v1/batches",
            json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT_URL, "completion_window": "24h"},
        )
        create_s = time.perf_counter() - start
        created.raise_for_status()
    batch = created.json()
    return {
        "lines": lines,
        "file_mb": file_bytes / 2**20,
        "upload_s": upload_s,
        "create_s": create_s,
        "rows_per_s": batch["request_counts"]["total"] / create_s,
        "batch_id": batch["id"],
        "num_requests": batch["request_counts"]["total"],
        "num_failed": batch["request_counts"]["failed"],
    }
