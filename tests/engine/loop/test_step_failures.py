"""An exception inside an engine step fails only the requests it hits; everything else carries on.

Faults come from the engine's own test hook (engine/testing/fault_injection.py: a prompt marker makes the
forward pass raise for that request) or from a real ModelRunner whose packed pass is made to fail
once (what running out of device memory on a large step looks like).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.loop.engine_host import EngineHost
from tokenloom.engine.outputs.outputs import EngineRequestError
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.engine.testing.fault_injection import FaultInjector, InjectedFault
from tokenloom.offline.offline_run import run_file
from tokenloom.settings.fault_injection_env import fault_injector_from_env

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MARKER = "POISON-PILL"
PROMPTS = [f"request {i} " * (1 + i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    return Engine(engine_config(llama_checkpoint, model=dict(max_model_len=128)))


@pytest.fixture(scope="module")
def expected(engine):
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture
def armed(engine, expected):
    engine.faults.arm(MARKER)
    yield engine
    engine.faults.arm(None)


def _assert_clean(engine: Engine) -> None:
    assert not engine.has_unfinished_requests
    assert not engine.scheduler.has_unfinished
    assert engine.kv_manager.pool.num_used_blocks == 0  # every failed request gave its blocks back


def test_poisoned_request_fails_alone_in_a_shared_step(armed, expected):
    poisoned = f"{MARKER} in the middle of a prompt"
    outputs = armed.generate(PROMPTS[:3] + [poisoned] + PROMPTS[3:], GREEDY)
    bad = outputs.pop(3)
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "InjectedFault" in bad.error and MARKER in bad.error
    assert [o.error for o in outputs] == [None] * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == expected  # neighbours unaffected
    _assert_clean(armed)


def test_host_fails_the_poisoned_future_and_keeps_serving(armed, expected):
    host = EngineHost(armed).start()
    try:
        futures = [host.submit(f"h{i}", p, params=GREEDY) for i, p in enumerate(PROMPTS)]
        bad = host.submit("poisoned", f"say {MARKER} twice", params=GREEDY)
        with pytest.raises(EngineRequestError, match="injected fault"):
            bad.result(timeout=60)
        assert [f.result(timeout=60).outputs[0].token_ids for f in futures] == expected
        later = host.submit("later", PROMPTS[0], params=GREEDY)  # the thread survived
        assert later.result(timeout=60).outputs[0].token_ids == expected[0]
        assert host.is_alive
    finally:
        host.stop(10)
    _assert_clean(armed)


def test_a_packed_pass_that_fails_once_is_rerun_chunk_by_chunk(engine, expected, monkeypatch):
    """A fault that is not any one request's (e.g. device OOM on the big step) costs nothing."""
    forward = engine.runner.forward
    failures = []

    def fails_when_packed(plan):
        if len(plan.chunks) > 1 and not failures:
            failures.append(len(plan.chunks))
            raise RuntimeError("out of memory on the packed step")
        return forward(plan)

    monkeypatch.setattr(engine.runner, "forward", fails_when_packed)
    outputs = engine.generate(PROMPTS, GREEDY)
    assert failures  # the fault did fire
    assert [o.error for o in outputs] == [None] * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    _assert_clean(engine)


def test_offline_run_writes_a_failed_line_and_finishes_the_file(armed, expected, tmp_path):
    source, dest = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"custom_id": "ok", "prompt": PROMPTS[0]},
        {"custom_id": "bad", "prompt": f"{MARKER}!"},
        {"custom_id": "ok2", "prompt": PROMPTS[1]},
    ]
    source.write_text(
        "".join(json.dumps({**line, "max_tokens": 10, "temperature": 0, "ignore_eos": True}) + "\n" for line in lines)
    )
    run_file(armed, source, dest, progress=False)
    records = [json.loads(line) for line in dest.read_text().splitlines()]
    assert [r["status"] for r in records] == ["succeeded", "failed", "succeeded"]
    assert records[1]["error"]["type"] == "server_error"
    assert records[1]["error"]["message"].startswith("engine error: ") and MARKER in records[1]["error"]["message"]
    _assert_clean(armed)


def test_the_env_var_arms_the_hook_and_an_unset_one_does_not():
    assert fault_injector_from_env({}).marker is None
    injector = fault_injector_from_env({"TOKENLOOM_FAULT_INJECT_PROMPT": "X!"})
    injector.note_request("a", "say X! now")
    injector.note_request("b", "harmless")
    injector.check(["b"])
    with pytest.raises(InjectedFault, match="request a"):
        injector.check(["b", "a"])


def test_the_env_var_arms_a_stall_a_fault_or_both():
    both = fault_injector_from_env({"TOKENLOOM_FAULT_INJECT_PROMPT": "X!;stall:SLOW"})
    assert (both.fail_marker, both.stall_marker) == ("X!", "SLOW")
    stall_only = fault_injector_from_env({"TOKENLOOM_FAULT_INJECT_PROMPT": "stall:SLOW"})
    assert (stall_only.fail_marker, stall_only.stall_marker) == (None, "SLOW")
    assert stall_only.marker is not None  # armed: the engine notes each request's prompt
    stall_only.note_request("a", "a SLOW prompt")
    stall_only.check(["a"])  # a stall never raises


def test_a_stalled_request_sleeps_in_each_of_its_steps_and_keeps_its_tokens(engine, monkeypatch):
    from tokenloom.engine.testing import fault_injection

    prompt = f"SLOW-MARKER {PROMPTS[1]}"
    [unstalled] = engine.generate([prompt], GREEDY)
    sleeps = []
    monkeypatch.setattr(fault_injection.time, "sleep", sleeps.append)  # count the stalls, don't wait them
    engine.faults.arm(None, stall="SLOW-MARKER")
    try:
        engine.generate(PROMPTS[:2], GREEDY)
        assert not sleeps  # unmarked requests never stall
        steps_before = engine.counters.num_steps
        [stalled] = engine.generate([prompt], GREEDY)
        steps = engine.counters.num_steps - steps_before
    finally:
        engine.faults.arm(None)
    assert steps >= GREEDY.max_tokens  # a token per step at most...
    assert sleeps == [fault_injection.STALL_STEP_S] * steps  # ...and each of its steps stalled first
    assert stalled.error is None and stalled.outputs[0].token_ids == unstalled.outputs[0].token_ids
    _assert_clean(engine)
