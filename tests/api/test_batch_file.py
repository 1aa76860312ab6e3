"""Structural checks of batch input files (api/batches/batch_file.py), without a server."""

from __future__ import annotations

import json

import pytest

from tokenloom.api.batches.batch_file import parse_batch_file
from tokenloom.api.errors import ApiError

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it


def line(custom_id: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": "x", **body}})


def refusal(content: bytes, max_lines: int = 10) -> str:
    with pytest.raises(ApiError) as err:
        parse_batch_file(content, max_lines)
    assert err.value.status_code == 400
    return err.value.message


def test_blank_lines_are_skipped_but_keep_the_physical_line_numbers():
    content = ("\ufeff" + line("a") + "\n\n   \n" + line("b") + "\r\n").encode()
    parsed = parse_batch_file(content, max_lines=2)
    assert [(p.number, p.custom_id, p.url) for p in parsed] == [
        (1, "a", "/v1/completions"),
        (4, "b", "/v1/completions"),
    ]
    assert json.loads(parsed[1].text)["custom_id"] == "b"


def test_refusals_name_the_line_and_what_to_fix():
    assert refusal(line("a").encode() + b"\n\xff\xfe\n").startswith("line 2 of the batch file: not UTF-8")
    assert refusal(b"") == "the batch file has no requests: upload one JSON object per line"
    assert "max_batch_lines" in refusal("\n".join(line(f"n{i}") for i in range(3)).encode(), max_lines=2)
    mixed = refusal((line("a") + "\n" + line("b", url="/v1/chat/completions")).encode())
    assert mixed.startswith("line 2") and "differs from line 1" in mixed
    assert "custom_id must be a non-empty string" in refusal(line("").encode())
    assert "custom_id must be" in refusal(line("x" * 513).encode())
    assert "unknown 'extra'" in refusal(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}).encode()
    )
    assert 'method must be "POST"' in refusal(line("a").replace('"POST"', '"GET"').encode())
    assert "body must be a JSON object" in refusal(line("a").replace('{"prompt": "x"}', "[]").encode())
    assert "not valid JSON" in refusal(("[" * 100_000).encode())
    assert "body.stream must be false" in refusal(line("a", stream="yes").encode())
    assert parse_batch_file(line("a", stream=False).encode(), 1)[0].body["stream"] is False
