"""Structural checks of an OpenAI batch input file (JSONL), at upload and again at batch creation.

A file that breaks these rules cannot become a batch at all, so it is refused whole with a 400
naming the first bad line (OpenAI reports such files at validation too). What a single request
gets wrong (a bad sampling value, a prompt too long for the model) is NOT checked here: that line
becomes a failed request in the batch's error file, and the other lines still run.

Rules: UTF-8; one JSON object per non-blank line with exactly `custom_id` (a non-empty string,
unique in the file), `method` "POST", `url` (a supported endpoint, the same on every line and,
at batch creation, the batch's endpoint) and `body` (an object without `stream: true`); at
least one line and at most [server] max_batch_lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenloom.engine.batch_input import CHAT_URL, COMPLETIONS_URL, ENVELOPE_KEYS

from tokenloom.api.errors import ApiError

SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)


@dataclass(slots=True, frozen=True)
class BatchLine:
    number: int  # 1-based physical line in the file
    text: str  # the line as uploaded (parsed again, fully, when the batch is created)
    custom_id: str
    url: str
    body: dict


def _refuse(number: int, message: str) -> ApiError:
    return ApiError(400, f"line {number} of the batch file: {message}", param="file", code="invalid_batch_file")


def parse_batch_file(content: bytes, max_lines: int) -> list[BatchLine]:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = content[: exc.start].count(b"\n") + 1
        raise _refuse(line, f"not UTF-8 text (byte {exc.start}): save the file as UTF-8 JSONL") from None
    lines: list[BatchLine] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(text.lstrip("\ufeff").splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) == max_lines:
            raise ApiError(400, f"the batch file has more than {max_lines:,} requests ([server] max_batch_lines): "
                                "split it into several batches", param="file", code="too_many_lines")
        line = _parse(number, raw)
        if line.custom_id in first_line_of:
            raise _refuse(number, f"duplicate custom_id {line.custom_id!r} (first used on line "
                                  f"{first_line_of[line.custom_id]}): each request needs its own custom_id")
        if lines and line.url != lines[0].url:
            raise _refuse(number, f"url {line.url!r} differs from line {lines[0].number}'s {lines[0].url!r}: "
                                  "a batch runs one endpoint, put each endpoint's requests in its own file")
        first_line_of[line.custom_id] = number
        lines.append(line)
    if not lines:
        raise ApiError(400, "the batch file has no requests: upload one JSON object per line",
                       param="file", code="empty_batch_file")
    return lines


def _parse(number: int, raw: str) -> BatchLine:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _refuse(number, f"not valid JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
    if not isinstance(obj, dict):
        raise _refuse(number, "each line must be a JSON object {custom_id, method, url, body}")
    missing, unknown = sorted(ENVELOPE_KEYS - set(obj)), sorted(set(obj) - ENVELOPE_KEYS)
    if missing or unknown:
        detail = "; ".join(part for part in (missing and f"missing {', '.join(missing)}",
                                             unknown and f"unknown {', '.join(map(repr, unknown))}") if part)
        raise _refuse(number, f"an OpenAI batch line has exactly custom_id, method, url and body ({detail})")
    custom_id, url, body = obj["custom_id"], obj["url"], obj["body"]
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512 or "\x00" in custom_id:
        raise _refuse(number, "custom_id must be a non-empty string of at most 512 characters, without NUL (U+0000)")
    if obj["method"] != "POST":
        raise _refuse(number, f"method must be \"POST\", got {json.dumps(obj['method'])}")
    if url not in SUPPORTED_URLS:
        raise _refuse(number, f"url must be one of {', '.join(SUPPORTED_URLS)}, got {json.dumps(url)}")
    if not isinstance(body, dict):
        raise _refuse(number, "body must be a JSON object (the request you would POST to url)")
    if body.get("stream") not in (None, False):
        raise _refuse(number, "body.stream must be false or absent: a batch request gets one complete response")
    return BatchLine(number, raw, custom_id, url, body)
