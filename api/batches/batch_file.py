"""Structural checks of an OpenAI batch input file (JSONL), at upload and again at batch creation.

A file that breaks these rules cannot become a batch at all, so it is refused whole with a 400
naming the first bad line (OpenAI reports such files at validation too). What a single request
gets wrong (a bad sampling value, a prompt too long for the model) is NOT checked here: that line
becomes a failed request in the batch's error file, and the other lines still run.

Rules: UTF-8; one JSON object per non-blank line with exactly `custom_id` (a non-empty string,
unique in the file), `method` "POST", `url` (a supported endpoint, the same on every line and,
at batch creation, the batch's endpoint) and `body` (an object without `stream: true`); at
least one line and at most [server] max_batch_lines, none longer than [server] max_body_mb.
The file is read in pieces (BatchFileParser): an upload of 200 MB is checked while it is stored.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tokenloom.api.errors import ApiError
from tokenloom.openai_protocol.batch_input import CHAT_URL, COMPLETIONS_URL, ENVELOPE_KEYS

SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)
UTF8_BOM = b"\xef\xbb\xbf"
UNBOUNDED = sys.maxsize


@dataclass(slots=True, frozen=True)
class BatchLine:
    number: int  # 1-based physical line in the file
    text: str  # the line as uploaded (parsed again, fully, when the batch is created)
    custom_id: str
    url: str
    body: dict


def _refuse(number: int, message: str) -> ApiError:
    return ApiError(400, f"line {number} of the batch file: {message}", param="file", code="invalid_batch_file")


class BatchFileParser:
    """Checks a batch file whose bytes arrive in pieces of any size (upload reads, stored chunks):
    complete lines come out of `feed` as soon as their newline arrives, so only the current line
    and the custom_ids seen so far are held, never the file.

    Lines end at "\n" (a trailing "\r" is dropped with the other surrounding whitespace). Splitting
    the bytes there is safe for UTF-8: no byte of a multi-byte character is 0x0A, so a character
    cut between two pieces is whole again in the pending line.
    """

    def __init__(self, max_lines: int, max_line_bytes: int):
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes
        self.num_lines = 0  # requests (non-blank lines) so far
        self._number = 0  # physical lines so far
        self._offset = 0  # file offset of the pending line's first byte
        self._pending = bytearray()
        self._first_line_of: dict[str, int] = {}
        self._first: BatchLine | None = None

    def feed(self, data: bytes) -> Iterator[BatchLine]:
        self._pending += data
        start = 0
        while (end := self._pending.find(b"\n", start)) != -1:
            line = self._line(bytes(self._pending[start:end]))
            self._offset += end + 1 - start
            start = end + 1
            if line is not None:
                yield line
        del self._pending[:start]
        if len(self._pending) > self.max_line_bytes:  # refused before the rest of the line is buffered
            raise self._too_long(self._number + 1)

    def finish(self) -> Iterator[BatchLine]:
        """The last line (without a newline), then the refusal of a file with no request."""
        if self._pending:
            line = self._line(bytes(self._pending))
            self._pending.clear()
            if line is not None:
                yield line
        if self._first is None:
            raise ApiError(
                400,
                "the batch file has no requests: upload one JSON object per line",
                param="file",
                code="empty_batch_file",
            )

    def _too_long(self, number: int) -> ApiError:
        return _refuse(
            number,
            f"longer than {self.max_line_bytes / 2**20:g} MiB, the largest single request "
            "([server] max_body_mb): shorten the request or raise the limit",
        )

    def _line(self, raw: bytes) -> BatchLine | None:
        self._number += 1
        number = self._number
        if len(raw) > self.max_line_bytes:
            raise self._too_long(number)
        bom = len(UTF8_BOM) if number == 1 and raw.startswith(UTF8_BOM) else 0
        try:
            text = raw[bom:].decode("utf-8")
        except UnicodeDecodeError as exc:
            at = self._offset + bom + exc.start
            raise _refuse(number, f"not UTF-8 text (byte {at}): save the file as UTF-8 JSONL") from None
        if not text.strip():
            return None
        if self.num_lines == self.max_lines:
            raise ApiError(
                400,
                f"the batch file has more than {self.max_lines:,} requests ([server] max_batch_lines): "
                "split it into several batches",
                param="file",
                code="too_many_lines",
            )
        line = _parse(number, text)
        if line.custom_id in self._first_line_of:
            raise _refuse(
                number,
                f"duplicate custom_id {line.custom_id!r} (first used on line "
                f"{self._first_line_of[line.custom_id]}): each request needs its own custom_id",
            )
        first = self._first or line
        if line.url != first.url:
            raise _refuse(
                number,
                f"url {line.url!r} differs from line {first.number}'s {first.url!r}: "
                "a batch runs one endpoint, put each endpoint's requests in its own file",
            )
        self._first_line_of[line.custom_id] = number
        self._first = first
        self.num_lines += 1
        return line


def parse_batch_lines(chunks: Iterable[bytes], max_lines: int, max_line_bytes: int = UNBOUNDED) -> Iterator[BatchLine]:
    """The file's requests, in order, checked as they are read; an ApiError(400) at the first bad line."""
    parser = BatchFileParser(max_lines, max_line_bytes)
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.finish()


def checked_chunks(chunks: Iterable[bytes], max_lines: int, max_line_bytes: int) -> Iterator[bytes]:
    """`chunks` unchanged, each passed on only once its complete lines passed the checks: stored
    while uploaded, a bad file stops the upload at its first bad line."""
    parser = BatchFileParser(max_lines, max_line_bytes)
    for chunk in chunks:
        for _ in parser.feed(chunk):
            pass
        yield chunk
    for _ in parser.finish():
        pass


def parse_batch_file(content: bytes, max_lines: int) -> list[BatchLine]:
    """A whole file already in memory (small files, tests)."""
    return list(parse_batch_lines([content], max_lines))


def _parse(number: int, raw: str) -> BatchLine:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _refuse(number, f"not valid JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
    if not isinstance(obj, dict):
        raise _refuse(number, "each line must be a JSON object {custom_id, method, url, body}")
    missing, unknown = sorted(ENVELOPE_KEYS - set(obj)), sorted(set(obj) - ENVELOPE_KEYS)
    if missing or unknown:
        detail = "; ".join(
            part
            for part in (
                missing and f"missing {', '.join(missing)}",
                unknown and f"unknown {', '.join(map(repr, unknown))}",
            )
            if part
        )
        raise _refuse(number, f"an OpenAI batch line has exactly custom_id, method, url and body ({detail})")
    custom_id, url, body = obj["custom_id"], obj["url"], obj["body"]
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512 or "\x00" in custom_id:
        raise _refuse(number, "custom_id must be a non-empty string of at most 512 characters, without NUL (U+0000)")
    if obj["method"] != "POST":
        raise _refuse(number, f'method must be "POST", got {json.dumps(obj["method"])}')
    if url not in SUPPORTED_URLS:
        raise _refuse(number, f"url must be one of {', '.join(SUPPORTED_URLS)}, got {json.dumps(url)}")
    if not isinstance(body, dict):
        raise _refuse(number, "body must be a JSON object (the request you would POST to url)")
    if body.get("stream") not in (None, False):
        raise _refuse(number, "body.stream must be false or absent: a batch request gets one complete response")
    return BatchLine(number, raw, custom_id, url, body)
