"""`Idempotency-Key` on the create endpoints: the official `openai` SDK's own retries, concurrent
submits, replays and refusals against the real stack (uvicorn, Postgres, Redis, a worker), and
the key rows' race and retention on a database of their own."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import openai
import pytest
from sqlalchemy import delete, func, select, text

from tests.api.conftest import STALL_MARKER
from tests.api.test_batches_e2e import chat_line, upload
from tokenloom.store import retention
from tokenloom.store.idempotency import IdempotencyClaim, KeyTakenError, enqueue_jobs_once, insert_claim
from tokenloom.store.models import Batch, BatchStatus, IdempotencyKey, Job, JobStatus, utcnow

GREEDY = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
NUM_CONCURRENT = 6


def sdk_for(stack, key: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, **{"max_retries": 0, "timeout": 60, **options})


def key_header(key: str) -> dict:
    return {"Idempotency-Key": key}


@pytest.fixture(scope="module")
def lab_a(stack) -> openai.OpenAI:
    return sdk_for(stack, stack.project_keys["lab-a"])


def job_ids_with_prompt(sessions, prompt: str) -> list[str]:
    with sessions() as session:
        return [str(i) for i in session.execute(select(Job.id).where(Job.prompt == prompt)).scalars()]


def unique(text_: str) -> str:
    return f"{text_} {uuid.uuid4().hex[:6]}"


def test_the_sdks_retries_after_timeouts_create_one_job(stack, stack_sessions):
    """max_retries=2: the SDK sends the request three times with the same headers; the stalled job
    cannot finish within a 1 s timeout (>= 100 * STALL_STEP_S = 5 s on any CPU), so each try times out."""
    attempts = []
    http_client = httpx.Client(event_hooks={"request": [attempts.append]})
    retrying = sdk_for(stack, stack.project_keys["lab-a"], max_retries=2, timeout=1.0, http_client=http_client)
    prompt, key = unique(f"{STALL_MARKER} retried"), str(uuid.uuid4())
    request = dict(model=stack.model, prompt=prompt, max_tokens=100, temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APITimeoutError):
        retrying.completions.create(**request, extra_headers=key_header(key))
    assert len(attempts) == 3
    assert {a.headers["Idempotency-Key"] for a in attempts} == {key}
    [job_id] = job_ids_with_prompt(stack_sessions, prompt)
    with stack.client(stack.project_keys["lab-a"]) as client:
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    # A fourth try after the job ended gets its result, from the same job.
    replayed = sdk_for(stack, stack.project_keys["lab-a"]).completions.with_raw_response.create(
        **request, extra_headers=key_header(key)
    )
    assert replayed.headers["x-job-id"] == job_id and replayed.headers["idempotent-replayed"] == "true"
    assert replayed.parse().choices[0].finish_reason == "abort"
    assert job_ids_with_prompt(stack_sessions, prompt) == [job_id]


def test_concurrent_completions_with_one_key_share_one_job_and_its_text(stack, lab_a, stack_sessions):
    prompt, key = unique("Once upon a time"), str(uuid.uuid4())
    start = threading.Barrier(NUM_CONCURRENT)

    def submit(_):
        start.wait()
        return lab_a.completions.with_raw_response.create(
            model=stack.model, prompt=prompt, **GREEDY, extra_headers=key_header(key)
        )

    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        replies = list(pool.map(submit, range(NUM_CONCURRENT)))
    [job_id] = job_ids_with_prompt(stack_sessions, prompt)
    assert {r.headers["x-job-id"] for r in replies} == {job_id}
    assert sum("idempotent-replayed" not in r.headers for r in replies) == 1
    assert len({r.parse().choices[0].text for r in replies}) == 1
    assert {r.parse().usage.completion_tokens for r in replies} == {8}


def test_concurrent_job_lists_with_one_key_create_the_list_once(stack, stack_sessions):
    prompts, key = [unique("list one"), unique("list two")], str(uuid.uuid4())
    body = [{"prompt": p, "max_tokens": 4, "temperature": 0} for p in prompts]
    start = threading.Barrier(NUM_CONCURRENT)

    def submit(_):
        with stack.client(stack.project_keys["lab-b"]) as client:
            start.wait()
            return client.post("/v1/jobs", json=body, headers=key_header(key))

    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        replies = list(pool.map(submit, range(NUM_CONCURRENT)))
    assert {r.status_code for r in replies} == {202}, [r.text for r in replies]
    expected = [job_ids_with_prompt(stack_sessions, p) for p in prompts]
    assert all(len(ids) == 1 for ids in expected)
    assert {tuple(r.json()["ids"]) for r in replies} == {tuple(ids[0] for ids in expected)}  # request order
    assert sum(r.headers.get("idempotent-replayed") != "true" for r in replies) == 1


def test_a_streamed_replay_relays_the_same_job_and_text(stack, lab_a):
    key, request = str(uuid.uuid4()), dict(model=stack.model, prompt=unique("The river"), stream=True, **GREEDY)

    def streamed():
        raw = lab_a.completions.with_raw_response.create(**request, extra_headers=key_header(key))
        return raw.headers, "".join(c.choices[0].text for c in raw.parse() if c.choices)

    (first_headers, first_text), (again_headers, again_text) = streamed(), streamed()
    assert again_headers["x-job-id"] == first_headers["x-job-id"]
    assert "idempotent-replayed" not in first_headers and again_headers["idempotent-replayed"] == "true"
    assert again_text == first_text and first_text


def test_the_same_key_with_another_body_or_endpoint_is_refused(stack, lab_a):
    key = str(uuid.uuid4())
    lab_a.completions.create(model=stack.model, prompt=unique("first"), **GREEDY, extra_headers=key_header(key))
    with pytest.raises(openai.UnprocessableEntityError) as other_body:
        lab_a.completions.create(model=stack.model, prompt=unique("second"), **GREEDY, extra_headers=key_header(key))
    assert other_body.value.body["code"] == "idempotency_key_reused"
    with pytest.raises(openai.UnprocessableEntityError) as other_endpoint:
        lab_a.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "hi"}], **GREEDY, extra_headers=key_header(key)
        )
    assert "to /v1/completions" in other_endpoint.value.body["message"]


def test_keys_are_scoped_per_project(stack):
    key, body = str(uuid.uuid4()), {"prompt": unique("tenant"), "max_tokens": 2}
    created = {}
    for project in ("lab-a", "lab-b"):
        with stack.client(stack.project_keys[project]) as client:
            first = client.post("/v1/jobs", json=body, headers=key_header(key))
            again = client.post("/v1/jobs", json=body, headers=key_header(key))
        assert first.status_code == again.status_code == 202
        assert "idempotent-replayed" not in first.headers and again.headers["idempotent-replayed"] == "true"
        assert again.json()["ids"] == first.json()["ids"]
        created[project] = first.json()["data"][0]
    assert created["lab-a"]["id"] != created["lab-b"]["id"]
    assert {p: job["project"] for p, job in created.items()} == {"lab-a": "lab-a", "lab-b": "lab-b"}


def test_a_key_longer_than_255_characters_is_a_400_and_creates_nothing(stack, lab_a, stack_sessions):
    prompt = unique("long key")
    with pytest.raises(openai.BadRequestError) as err:
        lab_a.completions.create(model=stack.model, prompt=prompt, **GREEDY, extra_headers=key_header("k" * 256))
    assert err.value.body["code"] == "invalid_idempotency_key" and "255" in err.value.body["message"]
    assert job_ids_with_prompt(stack_sessions, prompt) == []


def test_a_retried_batch_create_returns_the_first_batch(stack, lab_a, stack_sessions):
    uploaded = upload(lab_a, [chat_line("a", "idempotent batch", max_tokens=2)])
    key = str(uuid.uuid4())

    def create():
        return lab_a.batches.with_raw_response.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers=key_header(key),
        )

    first, again = create(), create()
    assert again.parse().id == first.parse().id
    assert "idempotent-replayed" not in first.headers and again.headers["idempotent-replayed"] == "true"
    with stack_sessions() as session:
        assert (
            session.execute(
                select(func.count()).select_from(Batch).where(Batch.input_file_id == uploaded.id)
            ).scalar_one()
            == 1
        )


# --- the key rows themselves, on a database of their own ----------------------------------------


@pytest.fixture
def own_database(migrated_database):
    _, engine, sessions = migrated_database
    return engine, sessions


def queued_job(prompt: str) -> Job:
    return Job(id=uuid.uuid4(), project="p", model="m", prompt=prompt, params={}, status=JobStatus.QUEUED)


def wait_until_a_backend_waits_on_a_lock(engine, thread: threading.Thread, outcome: list) -> None:
    """Wait until the second INSERT blocks on the first one's row lock.

    The probe runs in autocommit: inside one transaction Postgres serves pg_stat_activity from a
    snapshot taken at its first read, so a probe that looked before the INSERT blocked (a loaded
    machine starts the thread late) would never see it. The bound is generous; it ends early when
    the lock wait appears or the second thread ends (its outcome says why)."""
    deadline = time.monotonic() + 120
    probe_engine = engine.execution_options(isolation_level="AUTOCOMMIT")
    with probe_engine.connect() as probe:
        while not probe.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar_one():
            assert thread.is_alive(), f"the second request ended without waiting on the lock: {outcome}"
            assert time.monotonic() < deadline, "the second INSERT never waited on the first one's lock"
            time.sleep(0.02)


def test_a_key_held_by_an_uncommitted_request_makes_the_second_insert_fail_and_write_nothing(own_database):
    engine, sessions = own_database
    claim = IdempotencyClaim.of("p", "k", "/v1/jobs", {"prompt": "x"})
    first = sessions()
    first.begin()
    insert_claim(first, claim.record(job_ids=[]))  # inserted, not committed: the second must wait for it
    outcome: list[BaseException] = []

    def second():
        try:
            enqueue_jobs_once(sessions, None, claim, [queued_job("second")])  # app unused: it fails before sending
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    wait_until_a_backend_waits_on_a_lock(engine, thread, outcome)
    first.commit()
    first.close()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], KeyTakenError)
    with sessions() as session:
        assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_retention_deletes_keys_older_than_its_cutoff_and_a_batchs_key_goes_with_it(own_database):
    _, sessions = own_database
    old, new = utcnow() - timedelta(days=40), utcnow() - timedelta(days=1)
    batch = Batch(id=uuid.uuid4(), project="p", status=BatchStatus.IN_PROGRESS)
    old_job = Job(
        id=uuid.uuid4(),
        project="p",
        model="m",
        prompt="old",
        params={},
        status=JobStatus.SUCCEEDED,
        created_at=old,
        finished_at=old,
    )
    with sessions.begin() as session:
        session.add_all([batch, old_job])
        session.flush()
        session.add_all(
            [
                IdempotencyKey(
                    project="p",
                    idempotency_key="old",
                    endpoint="/v1/jobs",
                    request_hash="h",
                    job_ids=[str(old_job.id)],
                    created_at=old,
                ),
                IdempotencyKey(
                    project="p", idempotency_key="new", endpoint="/v1/jobs", request_hash="h", created_at=new
                ),
                IdempotencyKey(
                    project="p",
                    idempotency_key="batch",
                    endpoint="/v1/batches",
                    request_hash="h",
                    batch_id=batch.id,
                    created_at=new,
                ),
            ]
        )
    report = retention.prune(sessions, None, timedelta(days=30), batch_size=1)
    assert report.jobs == 1

    def keys() -> set[str]:
        with sessions() as session:
            return set(session.execute(select(IdempotencyKey.idempotency_key)).scalars())

    assert keys() == {"new", "batch"}
    with sessions.begin() as session:
        session.execute(delete(Batch).where(Batch.id == batch.id))
    assert keys() == {"new"}
