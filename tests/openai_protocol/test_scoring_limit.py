"""Scoring bounded (openai_protocol/scoring_limit.py, openai_response.py): the prompt-logprobs limit counted as
prompt tokens x (k + 1) x n, vLLM's `prompt_logprobs` without echo, echo's prompt part shared by the n choices,
and `tokenloom run` lines over the limit failing alone."""

from __future__ import annotations

import json

import openai.types
import openai.types.chat
import pytest

from tests.conftest import ORACLE_CONFIG, engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.offline.offline_run import run_file
from tokenloom.openai_protocol.openai_response import (
    CompletionOffsets,
    StoredResult,
    completion_body,
    vllm_prompt_logprobs,
)
from tokenloom.openai_protocol.scoring_limit import (
    PromptLogprobsTooLargeError,
    check_prompt_logprob_entries,
    prompt_logprob_entries,
)
from tokenloom.settings.config import ServerConfig

# A stored prompt: the first token (nothing predicts it), a scored one whose token is among its
# alternatives, a scored one whose token is not, and one a cancel left unscored.
PROMPT = [
    {"token_id": 1, "token": "<s>", "bytes": [60], "logprob": None, "top": None, "top_tokens": None},
    {
        "token_id": 5,
        "token": " a",
        "bytes": [32, 97],
        "logprob": -0.5,
        "top": [[7, -0.25], [5, -0.5]],
        "top_tokens": [{"token": " b", "bytes": [32, 98]}, {"token": " a", "bytes": [32, 97]}],
    },
    {
        "token_id": 9,
        "token": "c",
        "bytes": [99],
        "logprob": -3.0,
        "top": [[4, -0.1], [6, -2.0]],
        "top_tokens": [{"token": "d", "bytes": [100]}, {"token": "e", "bytes": [101]}],
    },
    {"token_id": 8, "token": "f", "bytes": [102], "logprob": None, "top": None, "top_tokens": None},
]
GENERATED = [
    {"token_id": 4, "token": "d", "bytes": [100], "logprob": -0.1, "top": [[4, -0.1]], "top_tokens": [{"token": "d"}]}
]


def test_the_limit_counts_prompt_tokens_times_alternatives_plus_one_times_n_and_says_so():
    params = SamplingParams(prompt_logprobs=5, n=2)
    assert prompt_logprob_entries(params, 100) == 100 * 6 * 2
    assert prompt_logprob_entries(SamplingParams(), 10**6) == 0  # none asked: nothing to count
    check_prompt_logprob_entries(params, 100, 1200)  # at the limit: fine
    with pytest.raises(PromptLogprobsTooLargeError) as info:
        check_prompt_logprob_entries(params, 101, 1200)
    message = str(info.value)
    assert "101 prompt tokens x (prompt_logprobs 5 + 1) x n 2 = 1,212 entries" in message
    assert "limit of 1,200 ([server] max_prompt_logprob_entries)" in message and info.value.param == "prompt_logprobs"
    with pytest.raises(PromptLogprobsTooLargeError) as info:  # echo with logprobs asked for them
        check_prompt_logprob_entries(SamplingParams(logprobs=1, prompt_logprobs=1), 700, 1200, echo=True, num_prompts=3)
    assert "700 prompt tokens (over 3 prompts) x (logprobs 1 + 1)" in str(info.value) and info.value.param == "logprobs"
    assert ServerConfig().max_prompt_logprob_entries == 500_000


def test_vllm_prompt_logprobs_per_token_hold_the_token_and_its_alternatives_with_ranks():
    shaped = vllm_prompt_logprobs(PROMPT)
    assert shaped[0] is None and shaped[3] is None  # nothing predicts the first; a cancel left the last unscored
    assert shaped[1] == {
        "5": {"logprob": -0.5, "rank": 2, "decoded_token": " a"},
        "7": {"logprob": -0.25, "rank": 1, "decoded_token": " b"},
    }
    assert list(shaped[2]) == ["9", "4", "6"]  # the prompt token first, as vLLM orders them
    assert shaped[2]["9"] == {"logprob": -3.0, "rank": None, "decoded_token": "c"}  # not among the top 2
    assert shaped[2]["6"]["rank"] == 2


def _result(n: int, *, echo: bool, chat: bool = False) -> StoredResult:
    choices = [{"index": i, "text": "d", "finish_reason": "length", "logprobs": GENERATED} for i in range(n)]
    return StoredResult(
        "ab" * 16, chat, 0, "m", choices, len(PROMPT), 1, echo_text="<s> acf" if echo else None, prompt_logprobs=PROMPT
    )


def test_prompt_logprobs_without_echo_are_on_every_completions_choice_and_once_on_a_chat_body():
    body = completion_body(_result(3, echo=False))
    expected = vllm_prompt_logprobs(PROMPT)
    assert [choice["prompt_logprobs"] for choice in body["choices"]] == [expected] * 3
    assert body["choices"][0]["prompt_logprobs"] is body["choices"][2]["prompt_logprobs"]  # one list, not n copies
    assert body["choices"][0]["logprobs"]["tokens"] == ["d"]  # the choice's own logprobs, no prompt in them
    openai.types.Completion.model_validate(body)
    chat = completion_body(_result(2, echo=False, chat=True))
    assert chat["prompt_logprobs"] == expected and "prompt_logprobs" not in chat["choices"][0]
    openai.types.chat.ChatCompletion.model_validate(chat)


def test_echo_is_unchanged_and_its_choices_share_the_prompt_part():
    body = completion_body(_result(3, echo=True))
    reference = CompletionOffsets().logprobs(PROMPT + GENERATED)  # what every echoed choice held before
    for choice in body["choices"]:
        assert choice["logprobs"] == reference and "prompt_logprobs" not in choice
        assert choice["text"] == "<s> acfd"
    first, second = (choice["logprobs"]["top_logprobs"] for choice in body["choices"][:2])
    assert first is not second and first[1] is second[1]  # each choice its own list, the prompt's items shared


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    checkpoint = build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", **ORACLE_CONFIG)
    return Engine(engine_config(checkpoint, model=dict(max_model_len=256)))


def test_run_lines_over_the_limit_fail_alone_and_the_rest_carry_vllm_prompt_logprobs(engine, tmp_path):
    ids = [1, 17, 42, 99, 5, 250, 31, 8, 8, 8]  # 10 prompt tokens
    lines = [
        {"custom_id": "fits", "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},  # 20
        {"custom_id": "too-many", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2},  # 30
        {"custom_id": "n", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "n": 3},  # 30
        {"custom_id": "echo", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2},  # 30
        {"custom_id": "chat", "messages": [{"role": "user", "content": "x" * 40}], "prompt_logprobs": 0},  # > 25
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for output_format in ("tokenloom", "openai"):
        out = tmp_path / f"{output_format}.jsonl"
        run_file(engine, src, out, progress=False, output_format=output_format, max_prompt_logprob_entries=25)
        results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
        if output_format == "tokenloom":
            assert results["fits"]["status"] == "succeeded" and len(results["fits"]["prompt_logprobs"]) == len(ids)
            failed = {key: results[key]["error"]["message"] for key in ("too-many", "n", "echo", "chat")}
        else:
            body = results["fits"]["response"]["body"]
            openai.types.Completion.model_validate(body)
            assert body["choices"][0]["prompt_logprobs"][0] is None and len(body["choices"][0]["prompt_logprobs"]) == 10
            assert all(str(t) in pos for t, pos in zip(ids[1:], body["choices"][0]["prompt_logprobs"][1:]))
            failed = {key: results[key]["response"]["body"]["error"]["message"] for key in ("too-many", "n", "echo")}
        assert "10 prompt tokens x (prompt_logprobs 2 + 1) x n 1 = 30 entries" in failed["too-many"]
        assert "x (prompt_logprobs 0 + 1) x n 3 = 30 entries, over this server's limit of 25" in failed["n"]
        assert "x (logprobs 2 + 1) x n 1 = 30 entries" in failed["echo"]
        if "chat" in failed:
            assert "prompt logprobs too large" in failed["chat"]
