"""Engine behaviour end to end on small real models (no mocks)."""

from __future__ import annotations

import pytest

from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams

STORIES_EXPECTED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)


@pytest.fixture(scope="module")
def llama_engine(llama_checkpoint):
    return Engine(engine_config(llama_checkpoint, model=dict(max_model_len=128)))


def test_stories260k_greedy_40_tokens_writes_the_known_story(stories260k):
    engine = Engine(engine_config(stories260k))
    output = engine.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert output.prompt_token_ids == [1, 403, 407, 261, 378]
    assert len(output.outputs[0].token_ids) == 40
    assert "Once upon a time" + output.outputs[0].text == STORIES_EXPECTED


def test_streamed_deltas_concatenate_to_the_final_text(stories260k):
    engine = Engine(engine_config(stories260k))
    engine.add_request("r", "Once upon a time", params=SamplingParams(temperature=0.0, max_tokens=40))
    deltas, final = [], None
    while engine.has_unfinished_requests:
        for output in engine.step():
            deltas.append(output.outputs[0].new_text)
            final = output
    assert final.finished and "".join(deltas) == final.outputs[0].text


def test_stop_string_ends_generation_and_is_trimmed(stories260k):
    engine = Engine(engine_config(stories260k))
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["Lily"])
    output = engine.generate(["Once upon a time"], params)[0].outputs[0]
    assert output.text == ", there was a little girl named "
    assert output.finish_reason == "stop" and output.stop_reason == "Lily"


def test_stop_token_id_ends_generation(stories260k):
    engine = Engine(engine_config(stories260k))
    full = engine.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=10))[0]
    stop_token = full.outputs[0].token_ids[3]
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_token])
    output = engine.generate(["Once upon a time"], params)[0].outputs[0]
    assert output.token_ids == full.outputs[0].token_ids[:4]
    assert output.finish_reason == "stop" and output.stop_reason == stop_token


def test_seeded_sampling_is_reproducible_across_batch_compositions(llama_engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    alone = llama_engine.generate(["hello there"], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n) for n in (5, 30, 12)]
    crowd = llama_engine.generate(
        ["a long prompt about engines and batches", "hello there", "x", "numbers 1 2 3"],
        [others[0], seeded, others[1], others[2]],
    )
    assert crowd[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20)
    assert llama_engine.generate(["hello there"], different_seed)[0].outputs[0].token_ids != alone


def test_n_completions_with_a_seed_differ_from_each_other(llama_engine):
    output = llama_engine.generate(["hello"], SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12))[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3


def test_ignore_eos_and_max_tokens_give_exact_lengths(llama_engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=17, ignore_eos=True)
    output = llama_engine.generate(["hi"], params)[0].outputs[0]
    assert len(output.token_ids) == 17 and output.finish_reason == "length"


def test_logprobs_are_returned_per_token(llama_engine):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    output = llama_engine.generate(["hi"], params)[0].outputs[0]
    assert len(output.logprobs) == 5
    for token_id, entry in zip(output.token_ids, output.logprobs):
        assert entry.token_id == token_id and len(entry.top) == 3 and entry.top[0][0] == token_id


def test_timing_metrics_follow_their_definitions(llama_engine):
    output = llama_engine.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    m = output.metrics
    assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s
    assert len(m.itl_s) == 7 and m.tpot_s == pytest.approx(sum(m.itl_s) / 7)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "prompt is empty"),
        ("word " * 400, SamplingParams(), "max_model_len"),
        ("hi", SamplingParams(max_tokens=-1), "max_tokens must be >= 0"),
        ("hi", SamplingParams(max_tokens=500), "lower max_tokens"),
        ("hi", SamplingParams(temperature=-0.5), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_request_is_refused_with_a_clear_error(llama_engine, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llama_engine.add_request("bad", prompt, params=params)
    assert not llama_engine.has_unfinished_requests


def test_unknown_sampling_field_is_refused():
    with pytest.raises(InvalidRequestError, match="unknown sampling field.*temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_bad_request_does_not_disturb_others(llama_engine):
    llama_engine.add_request("good", "hello", params=SamplingParams(temperature=0.0, max_tokens=6))
    with pytest.raises(InvalidRequestError):
        llama_engine.add_request("bad", "", params=SamplingParams())
    outputs = []
    while llama_engine.has_unfinished_requests:
        outputs.extend(o for o in llama_engine.step() if o.finished)
    expected = llama_engine.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert [o.request_id for o in outputs] == ["good"]
    assert outputs[0].outputs[0].token_ids == expected.outputs[0].token_ids


def test_abort_keeps_partial_output_and_frees_blocks(llama_engine):
    llama_engine.add_request("long", "hello", params=SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        llama_engine.step()
    final = llama_engine.abort("long")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 1 <= len(final.outputs[0].token_ids) < 50
    assert llama_engine.kv_manager.pool.num_free_blocks == llama_engine.kv_plan.num_blocks


def test_chat_messages_use_the_chat_template(llama_engine):
    messages = [{"role": "user", "content": "hello"}]
    ids = llama_engine.encode_prompt(messages=messages)
    assert llama_engine.loaded.encoder.decode(ids) == "<|user|>\nhello\n<|assistant|>\n"


def test_chat_without_template_says_how_to_set_one(stories260k):
    engine = Engine(engine_config(stories260k))
    with pytest.raises(InvalidRequestError, match=r"\[model\] chat_template"):
        engine.add_request("chat", messages=[{"role": "user", "content": "hi"}])


def test_chat_content_parts_are_joined_into_text(llama_engine):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    plain = [{"role": "user", "content": "hello"}]
    assert llama_engine.encode_prompt(messages=parts) == llama_engine.encode_prompt(messages=plain)


def test_min_tokens_that_cannot_fit_the_context_is_refused(llama_engine):
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        llama_engine.add_request("m", "hi", params=SamplingParams(min_tokens=200))


def test_non_list_stop_is_refused_with_a_clear_error():
    with pytest.raises(InvalidRequestError, match="stop must be a list"):
        SamplingParams.from_dict({"stop": 5})
