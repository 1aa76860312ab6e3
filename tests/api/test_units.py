"""Pure pieces of the API, no services: SSE chunks, key hashing, bearer parsing, error messages."""

from __future__ import annotations

import json
import uuid

from tokenloom.api.auth import bearer_token
from tokenloom.api.errors import validation_message
from tokenloom.api.openai.sse_chunks import DONE, ChunkShape, sse
from tokenloom.store.api_keys.key_secrets import KEY_MARKER, PREFIX_LEN, generate_key, hash_key, key_prefix

NEEDS_SERVICES = False  # pure logic beside the service tests: the fast tier runs it


def test_sse_frames_one_json_event_per_data_line():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def test_the_first_chat_chunk_carries_the_role_and_the_first_token():
    shape = ChunkShape.for_job(True, uuid.UUID(int=7), 1700000000, "m")
    first, later = shape.token(0, "Hel", first=True), shape.token(0, "lo", first=False)
    assert first["id"] == f"chatcmpl-{uuid.UUID(int=7).hex}" and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert later["choices"][0]["delta"] == {"content": "lo"} and later["choices"][0]["finish_reason"] is None


def test_finish_and_usage_chunks():
    chat = ChunkShape.for_job(True, "x", 0, "m")
    assert chat.finish(1, "stop", first=False)["choices"] == [
        {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    usage = chat.usage(5, 3)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    text = ChunkShape.for_job(False, "x", 0, "m")
    assert text.token(0, "a", first=True)["choices"][0]["text"] == "a"
    assert text.id == "cmpl-x" and text.token(0, "a", first=True)["object"] == "text_completion"


def test_keys_are_random_and_stored_only_as_sha256():
    key = generate_key()
    assert key.startswith(KEY_MARKER) and len(key) > 40 and generate_key() != key
    assert hash_key(key) == hash_key(key) and len(hash_key(key)) == 64 and key not in hash_key(key)
    assert key_prefix(key) == key[:PREFIX_LEN]


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer ") is None


def test_validation_messages_say_what_to_fix():
    message, param = validation_message(
        [
            {"loc": ("body", "colour"), "type": "extra_forbidden", "msg": "Extra inputs are not permitted"},
            {"loc": ("body", "messages"), "type": "missing", "msg": "Field required"},
            {"loc": ("body", "n"), "type": "greater_than_equal", "msg": "Input should be greater than or equal to 1"},
        ]
    )
    assert param == "colour"
    assert "unknown field 'colour'" in message and "'messages' is required" in message
    assert "'n': Input should be greater than or equal to 1" in message
    assert json.dumps(message)  # plain text
