"""Which request fields tokenloom acts on, accepts and ignores, or refuses: one rule for the API,
batch lines and `tokenloom run`.

The rule (documented in docs/api.md, "Request fields"):
- fields it acts on are the sampling fields (openai_protocol/batch_input.py) and the structured-output fields;
- fields OpenAI defines that do not change the output here are accepted and ignored (HARMLESS);
- fields that would change the output and are not supported are refused, naming the field
  (UNSUPPORTED, or a harmless-looking field whose value would change the output here);
- any other field is unknown: accepted and ignored with a warning (vLLM's behaviour), or refused
  when strict (`[server] strict_fields = true`), so a typo cannot pass unnoticed where that matters.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from tokenloom.engine import InvalidRequestError

# OpenAI fields that change nothing about the generated tokens here.
HARMLESS = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "stream_options",
        "parallel_tool_calls",
        "safety_identifier",
        "prompt_cache_key",
    }
)

# OpenAI / vLLM fields that would change the output and that tokenloom does not implement.
UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "verbosity": "verbosity is not supported",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of (server-side ranking of candidates) is not supported; use n",
    "guided_decoding_backend": "the grammar engine is fixed (xgrammar)",
    "guided_whitespace_pattern": "whitespace patterns are not supported",
}

# Values of an unsupported field that mean "feature off": those are harmless.
_OFF_VALUES = {
    "tools": ([],),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "suffix": ("",),
    "best_of": (1,),
}
_TOOL_CHOICE_OFF = ("none", "auto")  # with no tools, "auto" and "none" both mean plain text


class UnsupportedFieldError(InvalidRequestError):
    """A field that would change the output and is not supported; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class FieldCheck:
    """What a request set besides the fields acted on."""

    ignored: tuple[str, ...]  # harmless fields, accepted and ignored silently
    unknown: tuple[str, ...]  # fields nobody defines here: accepted and ignored with a warning


def check_fields(obj: dict, acted_on: frozenset[str], *, strict: bool, where: str = "") -> FieldCheck:
    """Classify the keys of one request object; raises UnsupportedFieldError for an unsupported
    field and, when `strict`, for an unknown one."""
    ignored, unknown = [], []
    for name in obj:
        if name in acted_on:
            continue
        value = obj[name]
        if name == "tool_choice":
            if value is None or value in _TOOL_CHOICE_OFF:
                ignored.append(name)
                continue
            raise UnsupportedFieldError(
                name,
                f"{where}tool_choice {value!r} is not supported: tool calling is "
                'not supported (send no tool_choice, or "none")',
            )
        if name in UNSUPPORTED:
            if value is None or value in _OFF_VALUES.get(name, ()):
                ignored.append(name)
                continue
            raise UnsupportedFieldError(name, f"{where}{name} is not supported: {UNSUPPORTED[name]}; remove it")
        if name in HARMLESS:
            ignored.append(name)
        else:
            unknown.append(name)
    if unknown and strict:
        raise UnsupportedFieldError(
            unknown[0],
            f"{where}{describe_unknown(unknown, acted_on)} ([server] "
            "strict_fields = true refuses fields tokenloom does not define)",
        )
    return FieldCheck(tuple(ignored), tuple(unknown))


def describe_unknown(unknown: tuple[str, ...] | list[str], known: frozenset[str]) -> str:
    """ "unknown field 'temprature' (did you mean 'temperature'?)" for each unknown field."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known | HARMLESS), n=1)
        parts.append(repr(name) + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown field{'s' if len(parts) > 1 else ''} {', '.join(parts)}"
