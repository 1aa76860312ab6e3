"""OpenAI streaming chunks (chat.completion.chunk / text_completion) and their SSE framing.

Pure functions: the relay decides what to send, these decide how it looks on the wire. The first
token's chunk also carries the assistant role (instead of an empty role-only chunk first), so the
first SSE line a client sees is the first token and "time to first line" is the real TTFT.
A token chunk carries the logprobs of its tokens (in the response's shape) when they were asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenloom.openai_protocol.openai_response import CompletionOffsets, chat_logprobs

DONE = b"data: [DONE]\n\n"
# An SSE comment: clients ignore it, proxies see traffic and keep the connection open.
KEEP_ALIVE = b": keep-alive\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


@dataclass(slots=True, frozen=True)
class ChunkShape:
    """What every chunk of one response shares."""

    chat: bool
    id: str
    created: int
    model: str

    @classmethod
    def for_job(cls, chat: bool, job_id, created: int, model: str) -> "ChunkShape":
        hex_id = job_id.hex if hasattr(job_id, "hex") else str(job_id)
        return cls(chat, f"{'chatcmpl' if chat else 'cmpl'}-{hex_id}", created, model)

    def _envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def token(self, index: int, text: str, first: bool, logprobs: dict | None = None) -> dict:
        """One delta: a token's text (may be "" while a multi-byte character is incomplete) and,
        when asked for, its tokens' logprobs (`ChunkLogprobs.of`)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return self._envelope([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
        return self._envelope([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}])

    def finish(self, index: int, finish_reason: str | None, first: bool) -> dict:
        """The closing chunk of one choice: no new text, its finish_reason."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            return self._envelope([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])
        return self._envelope([{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the token counts."""
        chunk = self._envelope([])
        chunk["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return chunk


@dataclass(slots=True)
class ChunkLogprobs:
    """Stored logprob entries of one response's deltas -> each chunk's `logprobs`; completions'
    text_offset runs on across the chunks of a choice."""

    chat: bool
    offsets: dict[int, CompletionOffsets] = field(default_factory=dict)  # per choice index

    def of(self, index: int, entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        return self.offsets.setdefault(index, CompletionOffsets()).logprobs(entries)
