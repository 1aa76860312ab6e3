"""One line of a batch input file (JSONL) -> a `BatchItem` to run, or a `BatchLineError`.

Two shapes are accepted, and bad input never raises: it becomes a `BatchLineError` whose
message says what to fix, so one bad line cannot stop a 50k-line run.

simple::

    {"custom_id": "q1", "prompt": "Hello", "max_tokens": 32, "temperature": 0}
    {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0.9}

    `custom_id` is optional (default "line-<n>"); exactly one of `prompt` (text or a list of
    token ids) and `messages`; plus sampling fields.

OpenAI Batch API::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [...], "max_completion_tokens": 32}}

    `custom_id` is required; url "/v1/chat/completions" takes `messages`, "/v1/completions"
    takes `prompt`; `model` is ignored (an offline run serves one model).

Sampling fields use OpenAI's names plus vLLM's extensions. `max_completion_tokens` is an alias
of `max_tokens`; chat-style `logprobs: true` + `top_logprobs: k` means k alternatives per token
(0 when `top_logprobs` is absent), completions-style integer `logprobs: k` means the same.
`echo: true` (completions) prepends the prompt to each choice, and with `logprobs: k` gives the
prompt's tokens logprobs as well (vLLM's `prompt_logprobs: k` asks for those alone); `max_tokens: 0`
then scores the prompt without generating.
`response_format`, `structured_outputs` (and vLLM's `guided_*`) constrain the output
(engine/structured_output/spec.py); `stream` may only be false. Every other field follows
openai_protocol/request_fields.py: harmless ones are ignored, unsupported ones fail the line naming the
field, unknown ones are ignored (listed in `BatchItem.unknown_fields`) unless `strict`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenloom.engine import STRUCTURED_OUTPUT_FIELDS as STRUCTURED_FIELDS
from tokenloom.engine import InvalidRequestError, SamplingParams, constraint_from_request
from tokenloom.openai_protocol.request_fields import UnsupportedFieldError, check_fields

OPENAI_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "n",
    "logit_bias",
)
VLLM_FIELDS = (
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "stop_token_ids",
    "skip_special_tokens",
    "prompt_logprobs",
)
ECHO_FIELD = "echo"  # /v1/completions: the prompt's text (and, with logprobs, its logprobs) before the choice's
ALIAS_FIELDS = ("max_completion_tokens", "top_logprobs")
CHECKED_FIELDS = ("stream",)  # must be false/absent
SAMPLING_FIELDS = frozenset(
    OPENAI_FIELDS + VLLM_FIELDS + ALIAS_FIELDS + STRUCTURED_FIELDS + CHECKED_FIELDS + (ECHO_FIELD,)
)
SIMPLE_KEYS = frozenset({"custom_id", "prompt", "messages"}) | SAMPLING_FIELDS
ENVELOPE_KEYS = frozenset({"custom_id", "method", "url", "body"})
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


@dataclass(slots=True)
class BatchItem:
    line_number: int  # 1-based physical line in the input file
    custom_id: str
    prompt: str | list[int] | None
    messages: list | None
    params: SamplingParams
    unknown_fields: tuple[str, ...] = ()  # accepted and ignored; worth a warning to whoever sent them
    echo: bool = False  # completions only: the answer starts with the prompt (and its logprobs)


@dataclass(slots=True)
class BatchLineError:
    line_number: int
    custom_id: str | None  # None when the line has no usable custom_id
    message: str
    param: str | None = None  # the field at fault, where one is


class _LineError(Exception):
    """Internal: carries a user-facing message up to `parse_line`."""


def parse_line(
    line: str, line_number: int, defaults: SamplingParams | None = None, *, strict: bool = False
) -> BatchItem | BatchLineError:
    """Parse one JSONL line; unset sampling fields come from `defaults` (the engine's). `strict`
    refuses unknown fields instead of ignoring them."""
    custom_id = None
    try:
        obj = _load_object(line)
        custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
        if ENVELOPE_KEYS & (set(obj) - {"custom_id"}):
            return _parse_openai(obj, line_number, defaults, strict)
        return _parse_simple(obj, line_number, defaults, strict)
    except UnsupportedFieldError as err:
        return BatchLineError(line_number, custom_id, str(err), param=err.field)
    except (_LineError, InvalidRequestError) as err:
        return BatchLineError(line_number, custom_id, str(err))
    except (TypeError, ValueError) as err:  # a type SamplingParams.from_dict did not foresee
        return BatchLineError(line_number, custom_id, f"invalid request: {err}")


def _load_object(line: str) -> dict:
    text = line.lstrip("\ufeff").strip()
    if not text:
        raise _LineError("empty line: expected a JSON object")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise _LineError(f"not valid JSON: {err.msg} at column {err.colno}") from None
    except RecursionError:
        raise _LineError("not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise _LineError(f"each line must be a JSON object, got {_json_type(obj)}")
    return obj


def _parse_simple(obj: dict, line_number: int, defaults: SamplingParams | None, strict: bool) -> BatchItem:
    fields = check_fields(obj, SIMPLE_KEYS, strict=strict)
    custom_id = obj.get("custom_id")
    if custom_id is None:
        custom_id = f"line-{line_number}"
    _check_custom_id(custom_id)
    prompt, messages = _prompt_or_messages(obj, allow_prompt=True, allow_messages=True)
    echo = _echo(obj, chat=messages is not None)
    params = _sampling_params(obj, defaults, echo)
    return BatchItem(line_number, custom_id, prompt, messages, params, fields.unknown, echo)


def _parse_openai(obj: dict, line_number: int, defaults: SamplingParams | None, strict: bool) -> BatchItem:
    _reject_unknown(obj, ENVELOPE_KEYS, "key in an OpenAI batch line")
    if "custom_id" not in obj:
        raise _LineError("OpenAI batch lines need a 'custom_id' (a string unique within the file)")
    _check_custom_id(obj["custom_id"])
    if obj.get("method") != "POST":
        raise _LineError(f'method must be "POST", got {json.dumps(obj.get("method"))}')
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise _LineError(f'url must be "{CHAT_URL}" or "{COMPLETIONS_URL}", got {json.dumps(url)}')
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _LineError(f"body must be a JSON object, got {_json_type(body)}")
    fields = check_fields(body, SAMPLING_FIELDS | {"prompt", "messages"}, strict=strict, where="body.")
    is_chat = url == CHAT_URL
    prompt, messages = _prompt_or_messages(body, allow_prompt=not is_chat, allow_messages=is_chat)
    echo = _echo(body, chat=is_chat)
    params = _sampling_params(body, defaults, echo)
    return BatchItem(line_number, obj["custom_id"], prompt, messages, params, fields.unknown, echo)


def _reject_unknown(obj: dict, allowed: frozenset[str], what: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise _LineError(f"unknown {what} {names}; allowed: {', '.join(sorted(allowed))}")


def _check_custom_id(custom_id) -> None:
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineError(f"custom_id must be a non-empty string, got {json.dumps(custom_id)}")


def _prompt_or_messages(obj: dict, *, allow_prompt: bool, allow_messages: bool):
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is not None and not allow_prompt:
        raise _LineError(f"'prompt' is not accepted by {CHAT_URL}: send 'messages', or use url {COMPLETIONS_URL}")
    if messages is not None and not allow_messages:
        raise _LineError(f"'messages' is not accepted by {COMPLETIONS_URL}: send 'prompt', or use url {CHAT_URL}")
    if prompt is not None and messages is not None:
        raise _LineError("give either 'prompt' or 'messages', not both")
    if prompt is None and messages is None:
        wanted = " or ".join(n for n, ok in (("'prompt'", allow_prompt), ("'messages'", allow_messages)) if ok)
        raise _LineError(f"missing {wanted}")
    if prompt is not None:
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not isinstance(prompt, str) and not is_ids:
            got = "a list with non-integer items" if isinstance(prompt, list) else _json_type(prompt)
            raise _LineError(f"prompt must be a string or a list of integer token ids (one prompt per line), got {got}")
    if messages is not None and (not isinstance(messages, list) or not messages):
        raise _LineError(f"messages must be a non-empty list of {{role, content}} objects, got {_json_type(messages)}")
    texts = [("prompt", prompt)] + [
        (f"messages[{i}].content", m.get("content")) for i, m in enumerate(messages or []) if isinstance(m, dict)
    ]
    for where, text in texts:
        _check_text(where, text)
    return prompt, messages


def _check_text(where: str, text) -> None:
    """Reject a lone UTF-16 surrogate (JSON "\\ud800"): it is not text and no tokenizer takes it."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise _LineError(f"{where} has an unpaired surrogate escape at character {err.start}") from None


def _echo(obj: dict, chat: bool) -> bool:
    echo = obj.get(ECHO_FIELD)
    if echo is None or echo is False:
        return False
    if echo is not True:
        raise _LineError(f"echo must be true or false, got {json.dumps(echo)}")
    if chat:
        raise _LineError(f"echo applies to {COMPLETIONS_URL} (a 'prompt'), not to chat messages")
    return True


def _sampling_params(obj: dict, defaults: SamplingParams | None, echo: bool = False) -> SamplingParams:
    values = {k: obj[k] for k in OPENAI_FIELDS + VLLM_FIELDS if k in obj}
    if obj.get("stream") not in (None, False):
        raise _LineError("stream must be false or absent: a batch line gets one complete result")
    _merge_max_tokens(values, obj.get("max_completion_tokens"))
    values["logprobs"] = _logprobs(obj.get("logprobs"), obj.get("top_logprobs"))
    if echo and values["logprobs"] is not None and values.get("prompt_logprobs") is None:
        # OpenAI's echo with logprobs: the prompt's tokens get logprobs too, with as many alternatives.
        values["prompt_logprobs"] = values["logprobs"]
    values["structured_outputs"] = constraint_from_request(obj)
    stop = values.get("stop")
    if stop is not None and not isinstance(stop, str) and not isinstance(stop, list):
        raise _LineError(f"stop must be a string or a list of strings, got {_json_type(stop)}")
    stop_ids = values.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise _LineError(f"stop_token_ids must be a list of integers, got {_json_type(stop_ids)}")
    return SamplingParams.from_dict(values, defaults)


def _merge_max_tokens(values: dict, alias) -> None:
    if alias is None:
        return
    current = values.get("max_tokens")
    if current is not None and current != alias:
        raise _LineError(f"max_tokens ({current}) and max_completion_tokens ({alias}) disagree: give only one")
    values["max_tokens"] = alias


def _logprobs(logprobs, top_logprobs) -> int | None:
    """Chat style (bool + top_logprobs) or completions style (int) -> alternatives per token."""
    if top_logprobs is not None:
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
            raise _LineError(f"top_logprobs must be an integer in [0, 20], got {json.dumps(top_logprobs)}")
        if logprobs is not True:
            raise _LineError('top_logprobs needs "logprobs": true')
    if logprobs is True:
        return top_logprobs if top_logprobs is not None else 0
    if logprobs is False:
        return None
    return logprobs  # None or a completions-style count, validated by SamplingParams


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"
