"""EngineHost: many client threads feeding one engine thread."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.loop.engine_host import EngineHost
from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    return Engine(engine_config(llama_checkpoint, model=dict(max_model_len=128)))


PROMPTS = [f"prompt number {i} " * (1 + i % 4) for i in range(12)]


@pytest.fixture(scope="module")
def expected(engine):
    # Computed before any host thread owns the engine: an Engine is driven by one thread at a time.
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture
def host(engine, expected):
    host = EngineHost(engine).start()
    yield host
    host.stop(10)


def test_requests_from_many_threads_are_batched_and_match_generate(engine, host, expected):
    prompts = PROMPTS
    steps_before = engine.counters.num_steps
    futures = [None] * len(prompts)

    def submit(i):
        futures[i] = host.submit(f"t{i}", prompts[i], params=GREEDY)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outputs = [f.result(timeout=60) for f in futures]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Batched: far fewer steps than running the 12 requests one after another (12 x 12 tokens).
    assert engine.counters.num_steps - steps_before < 12 * 12 / 2


def test_streaming_callback_sees_every_token(host):
    seen = []
    output = host.submit("stream", "hello", params=GREEDY, on_output=lambda o: seen.extend(o.outputs[0].new_token_ids))
    assert seen == output.result(timeout=60).outputs[0].token_ids


def test_invalid_request_fails_only_its_future(host):
    bad = host.submit("bad", "", params=GREEDY)
    good = host.submit("good", "hi", params=GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        bad.result(timeout=60)
    assert len(good.result(timeout=60).outputs[0].token_ids) == 12


def test_abort_resolves_with_partial_output(host):
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    started, abort_sent = threading.Event(), threading.Event()

    def hold_after_the_first_token(output):
        # Runs on the engine thread: it takes no further step until the abort is in the host's
        # inbox, which the host drains before its next step. However fast the machine, the request
        # is aborted after its first token, never finished first.
        if not started.is_set():
            started.set()
            assert abort_sent.wait(30)

    future = host.submit("long", "hello", params=long, on_output=hold_after_the_first_token)
    assert started.wait(30)
    host.abort("long")
    abort_sent.set()
    output = future.result(timeout=60)
    assert output.outputs[0].finish_reason == "abort" and len(output.outputs[0].token_ids) == 1


def test_stopping_the_host_fails_pending_requests(engine):
    host = EngineHost(engine).start()
    host.stop(10)
    with pytest.raises(RuntimeError, match="shutting down"):
        host.submit("late", "hi", params=GREEDY).result(timeout=10)


def test_a_factory_builds_the_engine_on_the_engine_thread(llama_checkpoint):
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return Engine(engine_config(llama_checkpoint))

    host = EngineHost(build).start()
    try:
        assert built_on == ["tokenloom-engine"] and host.engine is not None
        out = host.submit("r", [5, 6, 7], params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)).result(
            60
        )
        assert len(out.outputs[0].token_ids) == 3
    finally:
        host.stop(10)


def test_a_failed_build_is_raised_by_start():
    def build():
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        EngineHost(build).start()
