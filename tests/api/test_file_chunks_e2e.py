"""Files stored in chunks (store/files/file_chunks.py) through the real HTTP server and Postgres: uploads
round-trip byte for byte across chunk boundaries, a refused upload stores no chunk, a batch whose
input spans many chunks runs to the end, and the finalizer writes its output across chunks too.

CHUNK_BYTES is lowered with monkeypatch: the uvicorn server runs in this process (a thread), so
the upload and batch creation use the small chunks; the worker subprocess keeps the default.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from sqlalchemy import func, insert, select

from tests.api.conftest import MAX_BATCH_LINES
from tests.api.test_batches_e2e import CHAT_URL, GREEDY, chat_line, jsonl
from tokenloom.store.batches import batch_finalizer
from tokenloom.store.batches.batch_finalizer import error_line, finalize_if_done, output_line
from tokenloom.store.files import file_chunks
from tokenloom.store.models import Batch, BatchStatus, File, FileChunk, Job, JobStatus, utcnow

SMALL_CHUNK_BYTES = 256
WIDE_TEXT = "héllo wörld ✓ 日本語 🙂"  # 1- to 4-byte characters, so chunk cuts fall inside some


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(file_chunks, "CHUNK_BYTES", SMALL_CHUNK_BYTES)


@pytest.fixture(scope="module")
def sessions(stack_sessions):
    return stack_sessions


def stored_chunks(sessions, file_id: str) -> list[bytes]:
    with sessions() as session:
        return list(
            session.execute(
                select(FileChunk.data).where(FileChunk.file_id == file_id).order_by(FileChunk.seq)
            ).scalars()
        )


def wait_batch(client, batch_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.2)
    return batch


def utf8_jsonl(lines: list[dict]) -> bytes:
    """Non-ASCII characters written as UTF-8 (json.dumps would escape them as \\uXXXX)."""
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)


def upload(client, content: bytes, filename: str = "big.jsonl"):
    return client.post("/v1/files", files={"file": (filename, content)}, data={"purpose": "batch"})


def test_an_upload_of_many_chunks_round_trips_byte_identical(stack, sessions, small_chunks):
    content = utf8_jsonl([chat_line(f"r{i}", f"{WIDE_TEXT * 8} {i}") for i in range(MAX_BATCH_LINES)])
    continuation = [k for k in range(SMALL_CHUNK_BYTES, len(content), SMALL_CHUNK_BYTES) if content[k] & 0xC0 == 0x80]
    assert continuation  # some chunk boundary falls inside a multi-byte character
    with stack.client(stack.project_keys["lab-a"]) as client:
        uploaded = upload(client, content)
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        downloaded = client.get(f"/v1/files/{file_id}/content")
    assert uploaded.json()["bytes"] == len(content) and downloaded.content == content
    chunks = stored_chunks(sessions, file_id)
    assert len(chunks) == -(-len(content) // SMALL_CHUNK_BYTES) > 2
    assert {len(c) for c in chunks[:-1]} == {SMALL_CHUNK_BYTES}


def test_a_file_of_exactly_whole_chunks_keeps_every_line(stack, sessions, small_chunks):
    content = jsonl([chat_line("a", "first"), chat_line("b", "second")])
    content += b" " * (-len(content) % SMALL_CHUNK_BYTES - 1) + b"\n"  # trailing blanks are no request
    assert len(content) % SMALL_CHUNK_BYTES == 0
    with stack.client(stack.project_keys["lab-a"]) as client:
        uploaded = upload(client, content)
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        assert client.get(f"/v1/files/{file_id}/content").content == content
        batch = client.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT_URL, "completion_window": "24h"}
        )
    assert [len(c) for c in stored_chunks(sessions, file_id)] == [SMALL_CHUNK_BYTES] * (
        len(content) // SMALL_CHUNK_BYTES
    )
    assert batch.status_code == 200, batch.text
    assert batch.json()["request_counts"]["total"] == 2


def test_a_file_refused_after_several_chunks_stores_no_chunk(stack, sessions, small_chunks):
    lines = [chat_line(f"ok{i}", WIDE_TEXT) for i in range(10)] + [chat_line("ok0", "again")]
    filename = f"refused-{uuid.uuid4().hex}.jsonl"
    with stack.client(stack.project_keys["lab-a"]) as client:
        refused = upload(client, utf8_jsonl(lines), filename)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("line 11 of the batch file: duplicate custom_id 'ok0'")
    # Other tests share this stack and may be writing batch outputs, so count this upload's rows
    # only: no file row, and no chunk without a file row (every chunk references its file).
    with sessions() as session:
        assert (
            session.execute(select(func.count()).select_from(File).where(File.filename == filename)).scalar_one() == 0
        )
        orphans = select(func.count()).select_from(FileChunk).where(~FileChunk.file_id.in_(select(File.id)))
        assert session.execute(orphans).scalar_one() == 0


def test_a_batch_whose_input_spans_many_chunks_runs_end_to_end(stack, small_chunks):
    lines = [chat_line(f"c{i}", f"{WIDE_TEXT} {i}", max_tokens=2) for i in range(24)]
    with stack.client(stack.project_keys["lab-b"]) as client:
        file_id = upload(client, utf8_jsonl(lines)).json()["id"]
        created = client.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT_URL, "completion_window": "24h"}
        )
        assert created.status_code == 200, created.text
        batch = wait_batch(client, created.json()["id"])
        output = [json.loads(x) for x in client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 24, batch
    assert [line["custom_id"] for line in output] == [f"c{i}" for i in range(24)]
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 2 for line in output)


def test_the_finalizer_writes_outputs_across_chunks_and_pages_in_line_order(stack, sessions, small_chunks, monkeypatch):
    monkeypatch.setattr(batch_finalizer, "PAGE_ROWS", 3)
    batch_id, now = uuid.uuid4(), utcnow()
    jobs = []
    for line_number in range(1, 12):  # 9 succeeded, 2 failed (lines 4, 8); inserted in reverse
        ok = line_number % 4 != 0
        jobs.append(
            dict(
                id=uuid.uuid4(),
                batch_id=batch_id,
                project="lab-a",
                custom_id=f"f{line_number}",
                line_number=line_number,
                model=stack.model,
                endpoint=CHAT_URL,
                messages=[{"role": "user", "content": WIDE_TEXT}],
                params=GREEDY,
                status=JobStatus.SUCCEEDED if ok else JobStatus.FAILED,
                finished_at=now,
                output_text=f"{WIDE_TEXT} out {line_number}" if ok else None,
                finish_reason="length" if ok else None,
                prompt_tokens=3,
                completion_tokens=2 if ok else 0,
                error=None if ok else f"bad line {line_number}",
            )
        )
    with sessions.begin() as session:
        session.add(
            Batch(id=batch_id, project="lab-a", model=stack.model, status=BatchStatus.IN_PROGRESS, in_progress_at=now)
        )
        session.flush()
        session.execute(insert(Job), jobs[::-1])
    assert finalize_if_done(sessions, batch_id)
    with sessions() as session:
        rows = {job.line_number: job for job in session.execute(select(Job).where(Job.batch_id == batch_id)).scalars()}
        batch = session.get(Batch, batch_id)
    expected_output = b"".join(
        (json.dumps(output_line(rows[n]), ensure_ascii=False) + "\n").encode()
        for n in sorted(rows)
        if rows[n].status is JobStatus.SUCCEEDED
    )
    expected_errors = b"".join(
        (json.dumps(error_line(rows[n]), ensure_ascii=False) + "\n").encode()
        for n in sorted(rows)
        if rows[n].status is JobStatus.FAILED
    )
    with stack.client(stack.project_keys["lab-a"]) as client:
        output = client.get(f"/v1/files/{batch.output_file_id}/content").content
        errors = client.get(f"/v1/files/{batch.error_file_id}/content").content
        meta = client.get(f"/v1/files/{batch.output_file_id}").json()
    assert (batch.status, batch.total, batch.completed, batch.failed) == (BatchStatus.COMPLETED, 11, 9, 2)
    assert output == expected_output and errors == expected_errors and meta["bytes"] == len(output)
    assert len(stored_chunks(sessions, batch.output_file_id)) == -(-len(output) // SMALL_CHUNK_BYTES) > 2
