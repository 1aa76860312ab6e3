"""openai_protocol/openai_response.py: logprobs in OpenAI's chat and completions shapes from stored entries,
and `run_file(..., output_format="openai")` writing OpenAI Batch output lines."""

from __future__ import annotations

import json

import openai.types
import openai.types.chat
import pytest

from tests.conftest import ORACLE_CONFIG, engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.outputs.logprob_tokens import speller_for
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.offline.offline_run import run_file
from tokenloom.openai_protocol.openai_response import CompletionOffsets, StoredResult, chat_logprobs, completion_body

# " é" as two byte-level tokens: " " + [0xC3] and [0xA9] (the second completes the character).
ENTRIES = [
    {
        "token_id": 10,
        "token": "Hi",
        "bytes": [72, 105],
        "logprob": -0.5,
        "top": [[11, -0.25], [10, -0.5]],
        "top_tokens": [{"token": "Ho", "bytes": [72, 111]}, {"token": "Hi", "bytes": [72, 105]}],
    },
    {"token_id": 12, "token": " \ufffd", "bytes": [32, 0xC3], "logprob": None, "top": [], "top_tokens": []},
    {
        "token_id": 13,
        "token": "\ufffd",
        "bytes": [0xA9],
        "logprob": -1.0,
        "top": [[14, -0.75]],
        "top_tokens": [{"token": "!", "bytes": [33]}],
    },
    {"token_id": 15, "token": "!", "bytes": [33], "logprob": -2.0, "top": [], "top_tokens": []},
]


def test_chat_logprobs_have_openai_s_content_shape():
    shaped = chat_logprobs(ENTRIES)
    assert shaped["refusal"] is None
    first = shaped["content"][0]
    assert first == {
        "token": "Hi",
        "logprob": -0.5,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Ho", "logprob": -0.25, "bytes": [72, 111]},
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
        ],
    }
    assert shaped["content"][1]["logprob"] == -9999.0  # a stored null: OpenAI's floor, the schema needs a float
    openai.types.chat.ChatCompletion.model_validate(_chat_body(shaped))  # the SDK's own schema accepts it


def test_completion_logprobs_add_the_sampled_token_and_count_offsets_in_characters():
    shaped = CompletionOffsets().logprobs(ENTRIES)
    assert shaped["tokens"] == ["Hi", "bytes:\\x20\\xc3", "bytes:\\xa9", "!"]
    assert shaped["token_logprobs"] == [-0.5, -9999.0, -1.0, -2.0]
    assert shaped["top_logprobs"] == [
        {"Ho": -0.25, "Hi": -0.5},
        {"bytes:\\x20\\xc3": -9999.0},
        {"!": -0.75, "bytes:\\xa9": -1.0},
        {"!": -2.0},
    ]
    # Text "Hi é!": "é" starts at 3 and is complete only after the third token, so "!" is at 4.
    assert shaped["text_offset"] == [0, 2, 3, 4]


def test_completion_offsets_run_on_across_stream_chunks():
    offsets = CompletionOffsets()
    chunks = [offsets.logprobs([entry]) for entry in ENTRIES]
    assert [c["text_offset"][0] for c in chunks] == CompletionOffsets().logprobs(ENTRIES)["text_offset"]


def test_bodies_hold_null_logprobs_unless_asked_and_entries_without_spelling_name_the_id():
    result = StoredResult("ab" * 16, False, 0, "m", [{"index": 0, "text": "x", "logprobs": None}], 1, 1)
    assert completion_body(result)["choices"][0]["logprobs"] is None
    old = [{"token_id": 7, "logprob": -1.0, "top": [[7, -1.0], [8, -2.0]]}]  # stored before tokens were spelled
    body = completion_body(
        StoredResult(
            "ab" * 16, False, 0, "m", [{"index": 0, "text": "x", "logprobs": old, "finish_reason": "length"}], 1, 1
        )
    )
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"token_id:7": -1.0, "token_id:8": -2.0}]
    openai.types.Completion.model_validate(body)


def _chat_body(logprobs: dict) -> dict:
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi"},
                "logprobs": logprobs,
                "finish_reason": "stop",
            }
        ],
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    checkpoint = build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", **ORACLE_CONFIG)
    return Engine(engine_config(checkpoint, model=dict(max_model_len=256)))


def test_run_file_in_openai_format_writes_batch_output_lines_with_the_engine_s_logprobs(engine, tmp_path):
    chat = [{"role": "user", "content": "Tell me a story"}]
    lines = [
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": chat,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
        {
            "custom_id": "text",
            "prompt": "Once upon a time",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,
        },
        {"custom_id": "bad", "prompt": "x", "temperature": -1},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_file(engine, src, tmp_path / "out.jsonl", progress=False, output_format="openai")
    chat_line, text_line, bad_line = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    chat_ref, text_ref = (
        r.outputs[0] for r in engine.generate([engine.encode_prompt(messages=chat), "Once upon a time"], params)
    )
    speller = speller_for(engine.loaded.encoder.backend)

    assert chat_line["custom_id"] == "chat" and chat_line["response"]["status_code"] == 200
    chat_body = openai.types.chat.ChatCompletion.model_validate(chat_line["response"]["body"])
    content = chat_body.choices[0].logprobs.content
    assert [c.bytes for c in content] == [speller.spell(i)[1] for i in chat_ref.token_ids]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in chat_ref.logprobs], abs=1e-5)
    assert [[t.bytes for t in c.top_logprobs] for c in content] == [
        [speller.spell(i)[1] for i, _ in lp.top] for lp in chat_ref.logprobs
    ]

    text_body = openai.types.Completion.model_validate(text_line["response"]["body"])
    assert text_body.choices[0].text == text_ref.text
    assert text_body.choices[0].logprobs.token_logprobs == pytest.approx(
        [lp.logprob for lp in text_ref.logprobs], abs=1e-5
    )
    assert all(len(top) in (2, 3) for top in text_body.choices[0].logprobs.top_logprobs)

    assert bad_line["custom_id"] == "bad" and bad_line["response"]["status_code"] == 400
    assert "temperature" in bad_line["response"]["body"]["error"]["message"]


def test_run_file_refuses_an_unknown_output_format(engine, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="tokenloom, openai"):
        run_file(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False, output_format="csv")
