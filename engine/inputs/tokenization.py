"""Prompt text or chat messages -> token ids, with the checkpoint's (or a configured) chat template."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenloom.engine.sample.sampling_params import InvalidRequestError

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        backend = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("tokenizer has no fast (tokenizers) backend: the checkpoint needs a tokenizer.json")
        self.backend = backend  # tokenizers.Tokenizer, used for incremental decoding

    @classmethod
    def load(cls, path: str | Path, chat_template_path: str = "") -> "PromptEncoder":
        tokenizer = AutoTokenizer.from_pretrained(path)
        template = None
        if chat_template_path:
            file = Path(chat_template_path).expanduser()
            if not file.is_file():
                raise FileNotFoundError(f"[model] chat_template = {chat_template_path!r}: no such file")
            template = file.read_text()
        return cls(tokenizer, template)

    def encode_prompt(self, prompt: str | list[int] | None, messages: list | None, vocab_size: int) -> list[int]:
        """A request's prompt as token ids: chat messages through the template, text through the
        tokenizer, token ids checked against the vocabulary. The one rule of the API (before it
        queues a job) and the engine (for requests that reach it untokenized)."""
        if messages is not None:
            return self.encode_messages(messages)
        if isinstance(prompt, list):
            if not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt
            ):
                raise InvalidRequestError(f"prompt token ids must be a non-empty list of ints in [0, {vocab_size})")
            return list(prompt)
        if prompt is None:
            raise InvalidRequestError("a request needs 'prompt' (text or token ids) or 'messages'")
        return self.encode_text(prompt)

    def encode_text(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("prompt is empty: give at least one character of text")
        return list(self.tokenizer(prompt).input_ids)

    def encode_messages(
        self, messages: list[dict], *, add_generation_prompt: bool = True, add_special_tokens: bool = False
    ) -> list[int]:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template, so 'messages' cannot be used: send 'prompt' instead, "
                "or set [model] chat_template to a Jinja template file"
            )
        messages = _normalized_messages(messages)
        extra: dict[str, Any] = {"add_special_tokens": True} if add_special_tokens else {}
        ids = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **extra,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = cast(Mapping[str, Any], ids)["input_ids"]  # a dict or BatchEncoding holding the ids
        return list(ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # One flat sequence decodes to one string (a list of strings is for a batch of sequences).
        return cast(str, self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def _normalized_messages(messages) -> list[dict]:
    """Validate chat messages; OpenAI content parts ([{"type": "text", "text": ...}]) become one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in VALID_ROLES:
            raise InvalidRequestError(f"messages[{i}].role = {role!r}; allowed: {', '.join(VALID_ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, i)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts")
        normalized.append({**message, "content": content})
    return normalized


def _join_text_parts(parts: list, message_index: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f'messages[{message_index}].content[{j}] must be {{"type": "text", "text": ...}}: '
                "only text content is supported"
            )
        texts.append(part["text"])
    return "".join(texts)
