"""OpenAI's response objects built from a stored result: one shape for the API, batch files and
`tokenloom run --output-format openai`.

Pure functions over plain data: a finished request's stored choices (the worker's `jobs.choices`
or an offline result line's `choices`) become the `chat.completion` / `text_completion` body an
online request returns, and the `{"id", "custom_id", "response", "error"}` line of an OpenAI Batch
output file. Keeping them here, below store/ and api/, is what makes a `tokenloom run` output file
and a `/v1/batches` output file the same format.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResult:
    """What a response body is made from."""

    id_hex: str  # the job's (or run line's) id as 32 hex digits
    chat: bool  # chat.completion (messages) or text_completion (prompt)
    created: int  # unix seconds
    model: str
    choices: list[dict]  # stored choices: {index, text, finish_reason, logprobs, ...}
    prompt_tokens: int
    completion_tokens: int


def completion_body(result: StoredResult) -> dict:
    """The chat.completion or text_completion object an online request would have returned."""
    choices = []
    for stored in result.choices:
        choice: dict = {"index": stored.get("index", 0)}
        if result.chat:
            choice["message"] = {"role": "assistant", "content": stored.get("text") or ""}
        else:
            choice["text"] = stored.get("text") or ""
        choice["logprobs"] = None
        choice["finish_reason"] = stored.get("finish_reason")
        choices.append(choice)
    return {
        "id": f"{'chatcmpl' if result.chat else 'cmpl'}-{result.id_hex}",
        "object": "chat.completion" if result.chat else "text_completion",
        "created": result.created,
        "model": result.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    }


def batch_output_line(id_hex: str, custom_id: str | None, request_id: str, body: dict) -> dict:
    """One line of an OpenAI Batch output file (a request that succeeded)."""
    return {"id": f"batch_req_{id_hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def batch_error_line(id_hex: str, custom_id: str | None, request_id: str, message: str,
                     error_type: str = "invalid_request_error", status_code: int = 400) -> dict:
    """One line of an OpenAI Batch error file (a request that failed)."""
    return {"id": f"batch_req_{id_hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id,
                         "body": {"error": {"message": message, "type": error_type}}},
            "error": None}
