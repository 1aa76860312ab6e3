"""docker-compose.yml's commands and variables work: its migrate, api and worker-cpu services run
as local processes (tests/api/compose_stack.py), a job submitted through the API is run by the
worker and read back, and both healthchecks pass once the services are up."""

from __future__ import annotations

import subprocess

import pytest

from tests.api.compose_stack import LocalComposeStack, wait_for

JOB_DEADLINE_S = 180  # a bound for a broken stack, not a measure of speed


def test_the_services_use_the_files_commands_and_variables(compose_stack):
    services = compose_stack.services
    assert compose_stack.migrate.argv == services["migrate"]["command"] == ["tokenloom", "db", "upgrade"]
    assert compose_stack.worker.argv == services["worker-cpu"]["command"]
    assert compose_stack.api.argv[:2] == ["tokenloom", "serve"]
    for process, service in ((compose_stack.api, "api"), (compose_stack.worker, "worker-cpu")):
        for name, value in services[service]["environment"].items():
            expected = compose_stack.host_rewrites.get(name, "" if value is None else str(value))
            assert process.env[name] == expected, (service, name)
    assert compose_stack.worker.env["TOKENLOOM_MODEL_DEVICE"] == "cpu"
    assert compose_stack.api.env["TOKENLOOM_API_KEY"] == compose_stack.api_key


def test_a_job_submitted_to_the_api_is_run_by_the_worker_and_read_back(compose_stack):
    with compose_stack.client() as client:
        created = client.post(
            "/v1/jobs",
            json={
                "prompt": "compose smoke",
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "custom_id": "smoke",
            },
        )
        assert created.status_code == 202, created.text
        job_id = created.json()["ids"][0]

        def finished():
            job = client.get(f"/v1/jobs/{job_id}").json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        job = wait_for(finished, JOB_DEADLINE_S, "the job to finish", log=compose_stack.worker.log)
        assert client.get("/v1/jobs").status_code == 200
    assert job["status"] == "succeeded", job.get("error")
    assert job["custom_id"] == "smoke" and job["completion_tokens"] == 6 and job["model"] == compose_stack.model
    assert job["ttft_s"] > 0


def test_the_healthchecks_pass_once_the_services_are_up(compose_stack):
    assert compose_stack.healthcheck("api").returncode == 0
    # The worker's heartbeat (every [queue] lease_s / 3) reaches Redis some seconds after it started.
    check = wait_for(
        lambda: (done := compose_stack.healthcheck("worker-cpu")).returncode == 0 and done,
        120,
        "the worker healthcheck to pass",
        poll_s=1.0,
        log=compose_stack.worker.log,
    )
    assert "heartbeat" in check.stdout


def test_the_worker_healthcheck_fails_without_a_live_worker(compose_stack):
    """The same healthcheck against a Redis no worker publishes to: it must fail, not pass vacuously."""
    empty_db = compose_stack.host_rewrites["TOKENLOOM_QUEUE_BROKER_URL"].rsplit("/", 1)[0] + "/9"
    env = {**compose_stack.worker.env, "TOKENLOOM_QUEUE_BROKER_URL": empty_db}
    test = compose_stack.services["worker-cpu"]["healthcheck"]["test"]
    done = subprocess.run(test[1:], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "no worker" in done.stderr, done.stderr
