"""Batch finalization on a real Postgres: rows built directly, no worker."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from sqlalchemy import event, func, select

from tokenloom.store.batches.batch_finalizer import finalize_if_done
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.files.file_chunks import read_chunks
from tokenloom.store.jobs.job_service import cancel
from tokenloom.store.models import Batch, BatchStatus, File, Job, JobStatus, utcnow


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_sql_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _batch(
    sessions,
    statuses: list[JobStatus],
    endpoint: str = "/v1/completions",
    status: BatchStatus = BatchStatus.IN_PROGRESS,
) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A batch whose job i (line i + 1) has statuses[i]; inserted in reverse to test line order."""
    with sessions.begin() as session:
        batch = Batch(
            model="m",
            status=status,
            total=len(statuses),
            in_progress_at=utcnow(),
            cancelling_at=utcnow() if status is BatchStatus.CANCELLING else None,
        )
        session.add(batch)
        session.flush()
        jobs = []
        for i, st in enumerate(statuses):
            job = Job(
                id=uuid.uuid4(),
                batch_id=batch.id,
                custom_id=f"c{i}",
                line_number=i + 1,
                model="m",
                endpoint=endpoint,
                status=st,
                params={},
            )
            if endpoint == "/v1/chat/completions":
                job.messages = [{"role": "user", "content": f"hi {i}"}]
            else:
                job.prompt = f"prompt {i}"
            _finish(job, st, i)
            jobs.append(job)
        session.add_all(reversed(jobs))
        return batch.id, [j.id for j in jobs]


def _finish(job: Job, status: JobStatus, i: int) -> None:
    job.status = status
    if status is JobStatus.SUCCEEDED:
        job.output_text = f"out {i}"
        job.choices = [
            {
                "index": 0,
                "text": f"out {i}",
                "token_ids": [1, 2],
                "finish_reason": "length",
                "stop_reason": None,
                "logprobs": None,
            }
        ]
        job.prompt_tokens, job.completion_tokens, job.finish_reason = 3 + i, 2, "length"
    elif status is JobStatus.FAILED:
        job.error = f"bad line {i}"
    elif status is JobStatus.CANCELLED:
        job.error = "cancelled before it started"
    if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED):
        job.finished_at = utcnow()


def _set_status(sessions, job_id: uuid.UUID, status: JobStatus, i: int) -> None:
    with sessions.begin() as session:
        _finish(session.get(Job, job_id), status, i)


def _get_batch(sessions, batch_id) -> Batch:
    with sessions() as session:
        return session.get(Batch, batch_id)


def _lines(sessions, file_id: str) -> list[dict]:
    content = b"".join(read_chunks(sessions, file_id))
    with sessions() as session:
        assert session.get(File, file_id).bytes == len(content)
    return [json.loads(line) for line in content.decode().splitlines()]


def _file_count(sessions, batch_id) -> int:
    with sessions() as session:
        return session.execute(
            select(func.count()).select_from(File).where(File.filename.like(f"batch_{batch_id}_%"))
        ).scalar_one()


def test_finalizes_once_all_jobs_are_terminal_and_not_before(sessions):
    statuses = [JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED]
    batch_id, job_ids = _batch(sessions, statuses)
    assert not finalize_if_done(sessions, batch_id)
    _set_status(sessions, job_ids[0], JobStatus.SUCCEEDED, 0)
    assert not finalize_if_done(sessions, batch_id)
    batch = _get_batch(sessions, batch_id)
    assert batch.status is BatchStatus.IN_PROGRESS and batch.output_file_id is None and batch.finalizing_at is None

    _set_status(sessions, job_ids[1], JobStatus.SUCCEEDED, 1)
    assert finalize_if_done(sessions, batch_id)
    assert not finalize_if_done(sessions, batch_id)  # once only
    batch = _get_batch(sessions, batch_id)
    assert batch.status is BatchStatus.COMPLETED
    assert (batch.total, batch.completed, batch.failed) == (4, 2, 1)  # the cancelled job is neither
    assert batch.finalizing_at is not None and batch.completed_at is not None
    assert batch.finalizing_at <= batch.completed_at and batch.cancelled_at is None
    assert batch.output_file_id.startswith("file-") and batch.error_file_id.startswith("file-")
    assert _file_count(sessions, batch_id) == 2


def test_output_and_error_files_in_openai_batch_format_and_line_order(sessions):
    S, F = JobStatus.SUCCEEDED, JobStatus.FAILED
    statuses = [S, F, S, S, F, S]
    batch_id, job_ids = _batch(sessions, statuses)
    assert finalize_if_done(sessions, batch_id)
    batch = _get_batch(sessions, batch_id)
    assert (batch.completed, batch.failed) == (4, 2)
    with sessions() as session:
        output, error = session.get(File, batch.output_file_id), session.get(File, batch.error_file_id)
        assert (output.purpose, error.purpose) == ("batch_output", "batch_error")

    out = _lines(sessions, batch.output_file_id)
    wanted = [i for i, s in enumerate(statuses) if s is S]
    assert [line["custom_id"] for line in out] == [f"c{i}" for i in wanted]
    for i, line in zip(wanted, out):
        job_id = job_ids[i]
        assert line["id"] == f"batch_req_{job_id.hex}" and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"] == str(job_id)
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "m" and isinstance(body["created"], int)
        assert body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "text": f"out {i}", "logprobs": None, "finish_reason": "length"}]
        assert body["usage"] == {"prompt_tokens": 3 + i, "completion_tokens": 2, "total_tokens": 5 + i}

    err = _lines(sessions, batch.error_file_id)
    failed = [i for i, s in enumerate(statuses) if s is F]
    assert [line["custom_id"] for line in err] == [f"c{i}" for i in failed]
    for i, line in zip(failed, err):
        assert line["id"] == f"batch_req_{job_ids[i].hex}" and line["error"] is None
        assert line["response"] == {
            "status_code": 400,
            "request_id": str(job_ids[i]),
            "body": {"error": {"message": f"bad line {i}", "type": "invalid_request_error"}},
        }


def test_chat_jobs_become_chat_completions_and_no_error_file_without_failures(sessions):
    batch_id, _ = _batch(sessions, [JobStatus.SUCCEEDED] * 2, endpoint="/v1/chat/completions")
    assert finalize_if_done(sessions, batch_id)
    batch = _get_batch(sessions, batch_id)
    assert batch.error_file_id is None and (batch.completed, batch.failed) == (2, 0)
    out = _lines(sessions, batch.output_file_id)
    body = out[1]["response"]["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "out 1"}, "logprobs": None, "finish_reason": "length"}
    ]


def test_output_file_always_written_even_when_empty(sessions):
    batch_id, _ = _batch(sessions, [JobStatus.FAILED, JobStatus.FAILED])
    assert finalize_if_done(sessions, batch_id)
    batch = _get_batch(sessions, batch_id)
    assert batch.status is BatchStatus.COMPLETED and (batch.completed, batch.failed) == (0, 2)
    assert _lines(sessions, batch.output_file_id) == [] and len(_lines(sessions, batch.error_file_id)) == 2


def test_concurrent_calls_create_exactly_one_pair_of_files(sessions):
    for _ in range(3):
        batch_id, _ = _batch(sessions, [JobStatus.SUCCEEDED, JobStatus.FAILED] * 20)
        barrier = threading.Barrier(16)
        results: list[bool] = []
        errors: list[BaseException] = []

        def call():
            try:
                barrier.wait()
                results.append(finalize_if_done(sessions, batch_id))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors
        assert sorted(results) == [False] * 15 + [True]
        assert _file_count(sessions, batch_id) == 2
        batch = _get_batch(sessions, batch_id)
        assert batch.status is BatchStatus.COMPLETED and (batch.completed, batch.failed) == (20, 20)


def test_concurrent_last_jobs_finalize_exactly_once(sessions):
    """Each thread ends its own job and then calls finalize: the last to commit always wins."""
    n = 12
    batch_id, job_ids = _batch(sessions, [JobStatus.RUNNING] * n)
    barrier = threading.Barrier(n)
    results: list[bool] = []

    def finish(i):
        barrier.wait()
        _set_status(sessions, job_ids[i], JobStatus.SUCCEEDED, i)
        results.append(finalize_if_done(sessions, batch_id))

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results.count(True) == 1 and len(results) == n
    batch = _get_batch(sessions, batch_id)
    assert batch.status is BatchStatus.COMPLETED and batch.completed == n
    assert len(_lines(sessions, batch.output_file_id)) == n and _file_count(sessions, batch_id) == 1


def test_cancelling_batch_ends_cancelled(sessions):
    batch_id, job_ids = _batch(
        sessions, [JobStatus.SUCCEEDED, JobStatus.CANCELLING, JobStatus.CANCELLED], status=BatchStatus.CANCELLING
    )
    assert not finalize_if_done(sessions, batch_id)
    assert _get_batch(sessions, batch_id).status is BatchStatus.CANCELLING
    _set_status(sessions, job_ids[1], JobStatus.CANCELLED, 1)
    assert finalize_if_done(sessions, batch_id)
    batch = _get_batch(sessions, batch_id)
    assert batch.status is BatchStatus.CANCELLED and batch.cancelled_at is not None and batch.completed_at is None
    assert (batch.completed, batch.failed) == (1, 0) and batch.error_file_id is None
    assert [line["custom_id"] for line in _lines(sessions, batch.output_file_id)] == ["c0"]


def test_service_cancel_of_a_batch_with_nothing_running_finalizes_it(sessions):
    batch_id, _ = _batch(sessions, [JobStatus.SUCCEEDED, JobStatus.QUEUED, JobStatus.QUEUED])
    result = cancel(sessions, batch_id)
    assert (result["cancelled"], result["cancelling"], result["unchanged"]) == (2, 0, 1)
    batch = _get_batch(sessions, batch_id)
    assert batch.status is BatchStatus.CANCELLED and batch.cancelling_at is not None
    assert (batch.completed, batch.failed) == (1, 0) and batch.output_file_id is not None
    # Cancelling an ended batch changes nothing.
    cancel(sessions, batch_id)
    assert _get_batch(sessions, batch_id).status is BatchStatus.CANCELLED and _file_count(sessions, batch_id) == 1


def test_submit_of_a_file_with_only_invalid_lines_finalizes_at_once(sessions, tmp_path):
    from tokenloom.store.jobs.job_service import submit_file

    source = tmp_path / "bad.jsonl"
    source.write_text("{not json\n" + json.dumps({"custom_id": "x", "prompt": "hi", "temperature": -1}) + "\n")
    submitted = submit_file(sessions, None, source, model="m")  # no queued job: the app is never used
    assert submitted.num_invalid == 2
    batch = _get_batch(sessions, submitted.batch_id)
    assert batch.status is BatchStatus.COMPLETED and (batch.total, batch.completed, batch.failed) == (2, 0, 2)
    assert len(_lines(sessions, batch.error_file_id)) == 2 and _lines(sessions, batch.output_file_id) == []


def test_pages_of_lines_leave_prompt_logprobs_unread_but_the_lines_that_asked_carry_them(sessions):
    """Each line's prompt logprobs can be [server] max_prompt_logprob_entries entries: a page of 1,000 rows must
    not hold them all. The page query leaves the column out; only the lines that asked read theirs, one at a time."""
    S = JobStatus.SUCCEEDED
    batch_id, job_ids = _batch(sessions, [S] * 6)
    entries = [
        {"token_id": 1, "token": "<s>", "bytes": [60], "logprob": None, "top": None, "top_tokens": None},
        {
            "token_id": 5,
            "token": "a",
            "bytes": [97],
            "logprob": -0.5,
            "top": [[5, -0.5]],
            "top_tokens": [{"token": "a"}],
        },
    ]
    scoring = job_ids[1::2]
    with sessions.begin() as session:
        for job_id in scoring:
            job = session.get(Job, job_id)
            job.params, job.prompt_logprobs = {"prompt_logprobs": 0}, entries
    statements: list[str] = []

    def record(conn, cursor, statement, *args):
        statements.append(statement)

    engine = sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", record)
    try:
        assert finalize_if_done(sessions, batch_id)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    pages = [s for s in statements if "ORDER BY jobs.line_number" in s]
    assert pages and all("prompt_logprobs" not in page for page in pages)
    assert sum("jobs.prompt_logprobs" in s for s in statements) == len(scoring)  # one read per line that asked
    out = _lines(sessions, _get_batch(sessions, batch_id).output_file_id)
    for job_id, line in zip(job_ids, out):
        choice = line["response"]["body"]["choices"][0]
        if job_id in scoring:  # vLLM's prompt_logprobs, without echo
            assert choice["prompt_logprobs"] == [None, {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}]
        else:
            assert "prompt_logprobs" not in choice
