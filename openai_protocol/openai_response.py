"""OpenAI's response objects built from a stored result: one shape for the API, batch files and
`tokenloom run --output-format openai`.

Pure functions over plain data: a finished request's stored choices (the worker's `jobs.choices`
or an offline result line's `choices`) become the `chat.completion` / `text_completion` body an
online request returns, and the `{"id", "custom_id", "response", "error"}` line of an OpenAI Batch
output file. Keeping them here, below store/ and api/, is what makes a `tokenloom run` output file
and a `/v1/batches` output file the same format.

Logprobs come from the stored per-token entries (engine/outputs/logprob_tokens.py) in OpenAI's two shapes:
chat `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal"}`
and completions `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, whose
per-position dict holds the top alternatives plus the sampled token (so up to `logprobs` + 1
keys, as OpenAI documents). With `echo`, the prompt's text leads each completions choice's text and
its tokens lead the logprobs, the first with null `token_logprobs` and `top_logprobs` entries (a
stored entry whose `top` is null). A completions token whose bytes are not valid UTF-8 on their own
(part of a character) is named `bytes:\\xe2\\x80` as OpenAI names it, so such tokens stay
distinct keys. `text_offset` is where each token's text starts in the choice's text, in
characters: the characters its earlier tokens' bytes complete. Without echo, a request that asked for
`prompt_logprobs` gets them as vLLM returns them: a `prompt_logprobs` list on each completions choice
(once on a chat.completion body), per prompt token null or {token id: {logprob, rank, decoded_token}}.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

# OpenAI's floor for a logprob that is not a finite number (the response schema needs a float).
MIN_LOGPROB = -9999.0
_UTF8_DECODER = codecs.getincrementaldecoder("utf-8")


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
    echo_text: str | None = None  # completions' echo: the prompt's text, put before each choice's
    prompt_logprobs: list[dict] | None = None  # stored entries of the prompt's tokens (echo shows them)


def completion_body(result: StoredResult) -> dict:
    """The chat.completion or text_completion object an online request would have returned.

    The prompt's logprobs are converted once and shared by every choice: with `echo` each choice's
    lists start with the same converted prompt part (OpenAI's shape repeats it per choice, so the
    encoded body does; the objects are not copied), and without echo vLLM's `prompt_logprobs`
    (vllm_prompt_logprobs) is one list that every completions choice holds, or the chat body once."""
    echo = result.echo_text is not None and result.prompt_logprobs is not None and not result.chat
    echoed = _EchoedPrompt(result.prompt_logprobs) if echo and result.prompt_logprobs is not None else None
    # vLLM returns asked-for prompt logprobs without echo; with echo they are in each choice's logprobs already.
    prompt_logprobs = (
        vllm_prompt_logprobs(result.prompt_logprobs)
        if result.prompt_logprobs is not None and result.echo_text is None
        else None
    )
    choices = []
    for stored in result.choices:
        choice: dict = {"index": stored.get("index", 0)}
        if result.chat:
            choice["message"] = {"role": "assistant", "content": stored.get("text") or ""}
        else:
            choice["text"] = (result.echo_text or "") + (stored.get("text") or "")
        logprobs = stored.get("logprobs")
        if echoed is not None:
            # OpenAI's echo: the prompt's tokens lead the choice's logprobs (the first with null logprob)
            choice["logprobs"] = echoed.followed_by(logprobs or [])
        elif logprobs is None:
            choice["logprobs"] = None
        else:
            choice["logprobs"] = chat_logprobs(logprobs) if result.chat else CompletionOffsets().logprobs(logprobs)
        choice["finish_reason"] = stored.get("finish_reason")
        if prompt_logprobs is not None and not result.chat:
            choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    body: dict = {
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
    if prompt_logprobs is not None and result.chat:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def vllm_prompt_logprobs(entries: list[dict]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of stored prompt entries: per prompt token, None where nothing scored it
    (the first token; a position a cancel left unscored), else {token id: {logprob, rank, decoded_token}}
    for the prompt token and its alternatives (JSON keys are strings). `rank` is 1 for the most likely
    token; the prompt token's rank is known only when it is among the alternatives (else null)."""
    converted: list[dict | None] = []
    for entry in entries:
        top = entry.get("top")
        if top is None:
            converted.append(None)
            continue
        token, _ = _token(entry)
        spelled = [text for text, _ in _top_tokens(entry)]
        ranks = {alternative_id: rank for rank, (alternative_id, _) in enumerate(top, 1)}
        token_id = entry.get("token_id")
        position = {
            str(token_id): {
                "logprob": _logprob(entry.get("logprob")),
                "rank": ranks.get(token_id),
                "decoded_token": token,
            }
        }
        for rank, ((alternative_id, lp), text) in enumerate(zip(top, spelled), 1):
            position.setdefault(str(alternative_id), {"logprob": _logprob(lp), "rank": rank, "decoded_token": text})
        converted.append(position)
    return converted


class _EchoedPrompt:
    """The prompt's part of each echoed completions choice's logprobs, converted once."""

    def __init__(self, entries: list[dict]):
        self._offsets = CompletionOffsets()
        self._prompt = self._offsets.logprobs(entries)

    def followed_by(self, generated: list[dict]) -> dict:
        """A choice's logprobs: the prompt's lists (their items shared with every other choice), then its tokens'."""
        own = self._offsets.copy().logprobs(generated)
        return {key: self._prompt[key] + own[key] for key in self._prompt}


def merged_completion_body(bodies: list[dict]) -> dict:
    """One text_completion of several prompts' bodies (in prompt order): their choices re-indexed as
    prompt number x n + choice number, their usage summed; the first body's id."""
    if len(bodies) == 1:
        return bodies[0]
    choices = []
    for prompt_index, body in enumerate(bodies):
        n = len(body["choices"])
        choices += [{**choice, "index": prompt_index * n + choice["index"]} for choice in body["choices"]]
    usage = {key: sum(body["usage"][key] for body in bodies) for key in bodies[0]["usage"]}
    return {**bodies[0], "choices": choices, "usage": usage}


def batch_output_line(id_hex: str, custom_id: str | None, request_id: str, body: dict) -> dict:
    """One line of an OpenAI Batch output file (a request that succeeded)."""
    return {
        "id": f"batch_req_{id_hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def batch_error_line(
    id_hex: str,
    custom_id: str | None,
    request_id: str,
    message: str,
    error_type: str = "invalid_request_error",
    status_code: int = 400,
) -> dict:
    """One line of an OpenAI Batch error file (a request that failed)."""
    return {
        "id": f"batch_req_{id_hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status_code,
            "request_id": request_id,
            "body": {"error": {"message": message, "type": error_type}},
        },
        "error": None,
    }


def batch_expired_line(id_hex: str, custom_id: str | None, message: str) -> dict:
    """One line of an OpenAI Batch error file for a request its batch's window did not reach: no
    response, the error `batch_expired` (OpenAI's shape for an expired batch's unfinished lines)."""
    return {
        "id": f"batch_req_{id_hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "batch_expired", "message": message},
    }


def chat_logprobs(entries: list[dict]) -> dict:
    """chat.completion(.chunk) `logprobs` of stored entries."""
    content = []
    for entry in entries:
        token, token_bytes = _token(entry)
        content.append(
            {
                "token": token,
                "logprob": _logprob(entry.get("logprob")),
                "bytes": token_bytes,
                "top_logprobs": [
                    {"token": text, "logprob": _logprob(lp), "bytes": alt_bytes}
                    for (text, alt_bytes), (_, lp) in zip(_top_tokens(entry), entry.get("top") or [])
                ],
            }
        )
    return {"content": content, "refusal": None}


@dataclass(slots=True)
class CompletionOffsets:
    """Builds text_completion `logprobs` for one choice; a stream keeps one per choice, so each
    chunk's text_offset continues where the previous chunk's ended."""

    num_chars: int = 0  # characters of text before the next token
    _decoder: codecs.IncrementalDecoder = field(default_factory=lambda: _UTF8_DECODER("replace"))

    def copy(self) -> CompletionOffsets:
        """One that continues from here independently (each echoed choice goes on from the prompt's end)."""
        copied = CompletionOffsets(self.num_chars)
        copied._decoder.setstate(self._decoder.getstate())
        return copied

    def logprobs(self, entries: list[dict]) -> dict:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict | None] = []
        text_offset: list[int] = []
        for entry in entries:
            token, token_bytes = _token(entry)
            name = _completion_name(token, token_bytes)
            tokens.append(name)
            if entry.get("top") is None:  # an echoed prompt's first token: nothing predicts it
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token_logprobs.append(_logprob(entry.get("logprob")))
                top = {
                    _completion_name(text, alt_bytes): _logprob(lp)
                    for (text, alt_bytes), (_, lp) in zip(_top_tokens(entry), entry.get("top") or [])
                }
                top.setdefault(name, _logprob(entry.get("logprob")))
                top_logprobs.append(top)
            text_offset.append(self.num_chars)
            self.num_chars += len(self._decoder.decode(bytes(token_bytes)) if token_bytes is not None else token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


def _token(entry: dict) -> tuple[str, list[int] | None]:
    """(text, bytes) of an entry; an entry without a spelling (no `token`) is named by its id."""
    if "token" in entry:
        return entry["token"], entry.get("bytes")
    return f"token_id:{entry.get('token_id')}", None


def _top_tokens(entry: dict) -> list[tuple[str, list[int] | None]]:
    spelled = entry.get("top_tokens")
    if spelled is not None:
        return [(t["token"], t.get("bytes")) for t in spelled]
    return [(f"token_id:{pair[0]}", None) for pair in entry.get("top") or []]


def _completion_name(token: str, token_bytes: list[int] | None) -> str:
    if token_bytes is None:
        return token
    try:
        bytes(token_bytes).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)
    return token


def _logprob(value: float | None) -> float:
    return MIN_LOGPROB if value is None else max(value, MIN_LOGPROB)
