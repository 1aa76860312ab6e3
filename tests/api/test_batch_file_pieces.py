"""The batch file parser fed in pieces (api/batches/batch_file.py BatchFileParser): wherever the bytes are
cut, uploads and stored chunks give the same lines and the same refusals as the whole file."""

from __future__ import annotations

import json

import pytest

from tokenloom.api.batches.batch_file import checked_chunks, parse_batch_file, parse_batch_lines
from tokenloom.api.errors import ApiError

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it


def line(custom_id: str, prompt: str = "x") -> str:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt}},
        ensure_ascii=False,
    )


def pieces(content: bytes, size: int) -> list[bytes]:
    return [content[i : i + size] for i in range(0, len(content), size)]


def parsed(chunks: list[bytes], max_lines: int = 100) -> list[tuple[int, str, str]]:
    return [(p.number, p.custom_id, p.body["prompt"]) for p in parse_batch_lines(chunks, max_lines)]


CONTENT = ("\ufeff" + line("a", "héllo wörld ✓ 日本語") + "\r\n\n" + line("b", "🙂" * 5) + "\n" + line("c")).encode()


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64, len(CONTENT) - 1, len(CONTENT)])
def test_any_cut_of_the_bytes_gives_the_lines_of_the_whole_file(size):
    assert (
        parsed(pieces(CONTENT, size))
        == parsed([CONTENT])
        == [(1, "a", "héllo wörld ✓ 日本語"), (3, "b", "🙂" * 5), (4, "c", "x")]
    )


def test_a_multibyte_character_cut_between_two_pieces_is_whole_again():
    content = (line("a", "日本") + "\n").encode()
    cut = content.index("日".encode()) + 1  # inside the 3-byte character
    assert parsed([content[:cut], content[cut:]]) == [(1, "a", "日本")]


def test_a_file_ending_exactly_at_a_piece_boundary_loses_no_line():
    content = (line("a") + "\n" + line("b") + "\n").encode()
    half = len(content) // 2
    content += b" " * (2 * half - len(content))  # two equal pieces; trailing blanks are not requests
    assert len(content) % half == 0
    assert [n for n, _, _ in parsed(pieces(content, half))] == [1, 2]


def test_refusals_from_pieces_name_the_same_line_and_byte_as_the_whole_file():
    bad_utf8 = (line("a") + "\n").encode() + b'{"custom_id": "\xff"}\n'
    duplicate = (line("a") + "\n" + line("b") + "\n" + line("a")).encode()
    for content in (bad_utf8, duplicate):
        with pytest.raises(ApiError) as whole:
            parse_batch_file(content, 10)
        for size in (1, 4, 16):
            with pytest.raises(ApiError) as cut:
                list(parse_batch_lines(pieces(content, size), 10))
            assert cut.value.message == whole.value.message


def test_a_bad_byte_is_reported_at_its_offset_in_the_file():
    content = (line("a") + "\n").encode() + b'{"x": "\xff"}'
    offset = content.index(b"\xff")
    with pytest.raises(ApiError) as err:
        list(parse_batch_lines(pieces(content, 3), 10))
    assert err.value.message.startswith(f"line 2 of the batch file: not UTF-8 text (byte {offset})")


def test_a_line_longer_than_the_largest_request_is_refused_before_it_is_buffered():
    content = (line("a") + "\n" + line("b", "y" * 1000) + "\n").encode()
    with pytest.raises(ApiError) as err:
        list(parse_batch_lines(pieces(content, 64), 10, max_line_bytes=500))
    assert err.value.message.startswith("line 2 of the batch file: longer than") and "max_body_mb" in err.value.message


def test_checked_chunks_pass_the_bytes_through_and_refuse_at_the_first_bad_line():
    assert b"".join(checked_chunks(pieces(CONTENT, 5), 10, 10_000)) == CONTENT
    bad = (line("a") + "\n{oops\n" + line("b")).encode()
    passed = []
    with pytest.raises(ApiError) as err:
        for chunk in checked_chunks(pieces(bad, 8), 10, 10_000):
            passed.append(chunk)
    assert err.value.message.startswith("line 2 of the batch file: not valid JSON")
    assert len(b"".join(passed)) < bad.index(b"{oops") + 8  # stopped at the piece holding line 2's end
    with pytest.raises(ApiError) as err:
        list(checked_chunks([b"\n \n"], 10, 10_000))
    assert err.value.code == "empty_batch_file"
