"""offline/offline_run.py + openai_protocol/batch_output.py on the random-weights demo checkpoint (CPU)."""

import json

import pytest

from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.offline.offline_run import count_jobs, run_file
from tokenloom.openai_protocol.batch_output import RunSummary, percentile
from tokenloom.settings.config import load_config

MAX_NUM_SEQS = 2  # in-flight cap 8: the 13-job file below needs refills and reordering
CHAT = [{"role": "user", "content": "Tell me a story"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")
    config = load_config(None, env={}).replace("model", name=str(ckpt), max_model_len=256)
    config = config.replace("scheduler", max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256)
    return Engine(config)


def write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def read_jsonl(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def mixed_lines():
    return [
        {"custom_id": "slow", "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, **GREEDY},
        '{"custom_id": "broken", "prompt": ',  # malformed JSON
        "",  # blank: skipped, no result line
        {"custom_id": "neg", "prompt": "Hi", "temperature": -1},
        {"custom_id": "long", "prompt": "The quick brown fox " * 80, "max_tokens": 4},
        {"custom_id": "unk", "prompt": "Hi", "tools": [{"type": "function"}]},  # unsupported: changes the output
        {"messages": CHAT, "max_tokens": 5, **GREEDY},  # default custom_id line-7
        {
            "custom_id": "ids",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "x", "prompt": [1, 40, 50, 60], "max_tokens": 3, "logprobs": 2, **GREEDY},
        },
        {
            "custom_id": "chat-n2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": CHAT, "max_completion_tokens": 4, "n": 2, "seed": 7},
        },
        "   ",
        *(
            {"custom_id": f"fast-{i}", "prompt": f"Numbers like {i}", "max_tokens": 1 + i % 3, **GREEDY}
            for i in range(7)
        ),
    ]


@pytest.fixture(scope="module")
def mixed_run(engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    src = write_jsonl(tmp / "in.jsonl", mixed_lines())
    dst = tmp / "out.jsonl"
    seen = []
    add = engine.add_request

    def spy(*args, **kwargs):
        seen.append(engine.num_unfinished_requests)
        return add(*args, **kwargs)

    engine.add_request = spy
    try:
        summary = run_file(engine, src, dst, progress=False)
    finally:
        del engine.add_request
    return src, read_jsonl(dst), summary, seen


def test_one_result_per_non_blank_line_in_input_order(mixed_run):
    src, results, _, _ = mixed_run
    assert count_jobs(src) == len(results) == 15
    numbers = [i for i, l in enumerate(src.read_text().splitlines(), 1) if l.strip()]
    assert [r["line"] for r in results] == numbers
    assert [r["custom_id"] for r in results] == [
        "slow",
        None,
        "neg",
        "long",
        "unk",
        "line-7",
        "ids",
        "chat-n2",
        *(f"fast-{i}" for i in range(7)),
    ]


def test_bad_lines_fail_with_their_message(mixed_run):
    _, results, _, _ = mixed_run
    by_id = {r["line"]: r for r in results}
    expected = {2: "not valid JSON", 4: "temperature must be in", 5: "max_model_len", 6: "tools is not supported"}
    for line, needle in expected.items():
        r = by_id[line]
        assert r["status"] == "failed" and r["error"]["type"] == "invalid_request_error"
        assert needle in r["error"]["message"], r["error"]["message"]
        assert r["text"] is None and r["token_ids"] is None and r["choices"] == []
        assert r["completion_tokens"] == 0
    assert all(r["status"] == "succeeded" and r["error"] is None for r in results if r["line"] not in expected)


def test_good_lines_have_text_tokens_and_metrics(mixed_run, engine):
    _, results, _, _ = mixed_run
    for r in (r for r in results if r["status"] == "succeeded"):
        assert r["model"] == engine.model_name and r["token_ids"] and isinstance(r["text"], str)
        assert r["token_ids"] == r["choices"][0]["token_ids"] and r["text"] == r["choices"][0]["text"]
        assert r["finish_reason"] in ("stop", "length") and r["prompt_tokens"] > 0
        assert r["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])
        assert r["ttft_s"] >= 0 and r["e2e_s"] >= r["ttft_s"] and r["queue_s"] >= 0
    slow = results[0]
    assert len(slow["token_ids"]) == 12 and slow["finish_reason"] == "length"


def test_n_and_logprobs(mixed_run):
    _, results, _, _ = mixed_run
    chat = next(r for r in results if r["custom_id"] == "chat-n2")
    assert [c["index"] for c in chat["choices"]] == [0, 1] and chat["choices"][0]["logprobs"] is None
    ids = next(r for r in results if r["custom_id"] == "ids")
    assert ids["prompt_tokens"] == 4
    lps = ids["choices"][0]["logprobs"]
    assert len(lps) == len(ids["token_ids"])
    for lp, tok in zip(lps, ids["token_ids"]):
        assert lp["token_id"] == tok and lp["logprob"] <= 0 and len(lp["top"]) == 2
        assert lp["top"][0][1] >= lp["logprob"]  # greedy: the chosen token is the top one


def test_greedy_lines_match_generate(mixed_run, engine):
    _, results, _, _ = mixed_run
    greedy = [r for r in results if r["status"] == "succeeded" and r["custom_id"] != "chat-n2"]
    specs = {l.get("custom_id", "line-7"): l for l in mixed_lines() if isinstance(l, dict)}
    prompts, params = [], []
    for r in greedy:
        spec = specs[r["custom_id"]]
        body = spec.get("body", spec)
        prompts.append(body["prompt"] if "prompt" in body else engine.encode_prompt(messages=body["messages"]))
        params.append(
            SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=body.get("ignore_eos", False))
        )
    expected = engine.generate(prompts, params)
    assert [r["token_ids"] for r in greedy] == [o.outputs[0].token_ids for o in expected]
    assert [r["text"] for r in greedy] == [o.outputs[0].text for o in expected]


def test_in_flight_is_bounded(mixed_run):
    _, _, _, seen = mixed_run
    assert seen and max(seen) < 4 * MAX_NUM_SEQS


def test_summary_counts(mixed_run):
    _, results, summary, _ = mixed_run
    assert isinstance(summary, RunSummary)
    assert (summary.requests_ok, summary.requests_failed, summary.requests_total) == (11, 4, 15)
    assert summary.output_tokens == sum(r["completion_tokens"] for r in results)
    assert summary.prompt_tokens == sum(r["prompt_tokens"] or 0 for r in results)
    assert summary.wall_s > 0 and summary.output_tok_s > 0 and summary.total_tok_s > summary.output_tok_s
    assert 0 < summary.ttft_p50_s <= summary.ttft_p90_s <= summary.ttft_p99_s
    assert summary.tpot_p50_s is not None and summary.mean_batch_size >= 1
    assert summary.preemptions >= 0 and 0 <= summary.prefix_cache_hit_rate <= 1
    text = summary.format()
    for needle in ("11 succeeded", "4 failed", "TTFT", "TPOT", "tok/s", "prefix cache"):
        assert needle in text


def test_invalid_utf8_line_fails_alone(engine, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt": "\xff\xfe"}\n{"prompt": "Hi", "max_tokens": 2}\n')
    summary = run_file(engine, src, tmp_path / "out.jsonl", progress=False)
    results = read_jsonl(tmp_path / "out.jsonl")
    assert [r["status"] for r in results] == ["failed", "succeeded"]
    assert "UTF-8" in results[0]["error"]["message"]
    assert (summary.requests_ok, summary.requests_failed) == (1, 1)
    assert not engine.has_unfinished_requests


def test_empty_file(engine, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["", "  "])
    summary = run_file(engine, src, tmp_path / "out.jsonl", progress=True)
    assert (tmp_path / "out.jsonl").read_text() == ""
    assert summary.requests_total == 0 and summary.ttft_p50_s is None
    assert "n/a" in summary.format()


def test_percentile_interpolates_linearly():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0


def test_lone_surrogate_custom_id_round_trips(engine, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "\\udc00x", "prompt": "a\\ud800"}\n{"prompt": "Hi", "max_tokens": 2}\n')
    run_file(engine, src, tmp_path / "out.jsonl", progress=False)
    results = read_jsonl(tmp_path / "out.jsonl")
    assert results[0]["custom_id"] == "\udc00x" and results[0]["status"] == "failed"
    assert "surrogate" in results[0]["error"]["message"] and results[1]["status"] == "succeeded"


def test_unknown_fields_are_ignored_with_one_warning_per_name(engine, tmp_path, caplog):
    lines = [
        {"custom_id": f"u{i}", "prompt": "Hi", "max_tokens": 2, "frobnicate": i, "temprature": 0} for i in range(3)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    with caplog.at_level("WARNING", logger="tokenloom"):
        summary = run_file(engine, src, tmp_path / "out.jsonl", progress=False)
    assert summary.requests_ok == 3 and summary.requests_failed == 0
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "'temprature' (did you mean 'temperature'?)" in warnings[0], warnings


@pytest.mark.parametrize("output_format", ["tokenloom", "openai"])
def test_scoring_lines_carry_prompt_logprobs_and_echo(engine, tmp_path, output_format):
    prompt = [1, 40, 41, 42, 43]
    lines = [
        {
            "custom_id": "echo",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
        },
        {"custom_id": "vllm", "prompt": "Hi there", "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    run_file(engine, src, tmp_path / "out.jsonl", progress=False, output_format=output_format)
    echo, vllm = read_jsonl(tmp_path / "out.jsonl")
    [expected] = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
    expected_logprobs = [e.logprob for e in expected.prompt_logprobs[1:]]
    if output_format == "tokenloom":
        assert echo["echo"] == engine.decode(prompt) and echo["completion_tokens"] == 0
        assert echo["prompt_logprobs"][0]["logprob"] is None and echo["prompt_logprobs"][0]["top"] is None
        assert [e["logprob"] for e in echo["prompt_logprobs"][1:]] == pytest.approx(expected_logprobs, abs=1e-5)
        assert vllm["echo"] is None and all(len(e["top"]) == 2 for e in vllm["prompt_logprobs"][1:])
    else:
        choice = echo["response"]["body"]["choices"][0]
        assert choice["text"] == engine.decode(prompt) and choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected_logprobs, abs=1e-5)
        assert vllm["response"]["body"]["choices"][0]["logprobs"] is None  # prompt_logprobs alone: no echo
