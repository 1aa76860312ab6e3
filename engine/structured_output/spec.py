"""Request fields -> one canonical structured-output constraint, checked before anything is queued.

A constraint is a one-key dict, JSON-serialisable so it travels in a job row's `params`:

    {"json": <schema object>}     response_format json_schema, structured_outputs.json
    {"json_object": true}         response_format json_object, structured_outputs.json_object
    {"regex": "<pattern>"}        structured_outputs.regex
    {"choice": ["a", "b", ...]}   structured_outputs.choice (the output is exactly one of them)
    {"grammar": "<EBNF>"}         structured_outputs.grammar (xgrammar's EBNF, GBNF-like)

Where the request can set it: OpenAI's `response_format` and vLLM's `structured_outputs` object (and
vLLM's older top-level `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`). Giving
two constraints is an error that names both.
"""

from __future__ import annotations

import functools
import json
import re

from tokenloom.engine.sample.sampling_params import InvalidRequestError
from tokenloom.engine.structured_output.json_string_fix import safe_json_grammar

KINDS = ("json", "json_object", "regex", "choice", "grammar")
GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
REQUEST_FIELDS = ("response_format", "structured_outputs", *GUIDED_ALIASES)
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1_000_000

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; users need only the message.
_NATIVE_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def constraint_from_request(body: dict) -> dict | None:
    """The request's constraint (canonical, checked to compile) or None; InvalidRequestError names
    the field and what to change."""
    found: list[tuple[str, dict]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(("structured_outputs", _from_structured_outputs(structured)))
    for alias, kind in GUIDED_ALIASES.items():
        if body.get(alias) is not None:
            found.append((alias, canonical({kind: body[alias]}, alias)))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(f"{' and '.join(name for name, _ in found)} both constrain the output: give only one")
    return found[0][1]


def _from_response_format(value) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError(
            'response_format must be an object with a "type": "text", "json_object" or "json_schema"'
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidRequestError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        schema = inner.get("schema", {})
        return canonical({"json": schema}, "response_format.json_schema.schema")
    raise InvalidRequestError(
        f'response_format type {kind!r} is not supported: use "text", "json_object" or "json_schema"'
    )


def _from_structured_outputs(value) -> dict:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object with one of: " + ", ".join(KINDS))
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS) - {"disable_any_whitespace", "whitespace_pattern"})
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs has unsupported key(s) {', '.join(unknown)}; supported: {', '.join(KINDS)}"
        )
    kinds = [k for k in KINDS if k in given]
    if len(kinds) != 1:
        raise InvalidRequestError(
            f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {', '.join(kinds) or 'none'}"
        )
    return canonical({kinds[0]: given[kinds[0]]}, f"structured_outputs.{kinds[0]}")


def canonical(constraint: dict, where: str = "structured output") -> dict:
    """Check a one-key constraint's value and that it compiles; returns it in canonical form."""
    if not isinstance(constraint, dict) or len(constraint) != 1 or next(iter(constraint)) not in KINDS:
        raise InvalidRequestError(f"{where}: a constraint is one of {', '.join(KINDS)}")
    kind, value = next(iter(constraint.items()))
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise InvalidRequestError(f"{where} is not valid JSON: {err.msg}") from None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{where} must be a JSON schema object")
        _check_size(where, json.dumps(value))
    elif kind == "json_object":
        value = True
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{where} must be a non-empty string")
        _check_size(where, value)
    elif kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequestError(f"{where} must be a list of 1 to {MAX_CHOICES} non-empty strings")
        _check_size(where, "".join(value))
    result = {kind: value}
    _check_compiles(json.dumps(result, sort_keys=True), where)
    return result


def _check_size(where: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"{where} is {len(text):,} characters; at most {MAX_SPEC_CHARS:,}")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (each taken literally)."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def native_message(exc: BaseException) -> str:
    """xgrammar's error without its source-file prefix."""
    return _NATIVE_PREFIX.sub("", str(exc)).strip()


def grammar_of(constraint: dict):
    """The xgrammar Grammar of a canonical constraint (no tokenizer needed)."""
    import xgrammar as xgr

    kind, value = next(iter(constraint.items()))
    if kind == "json":
        return safe_json_grammar(xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=False))
    if kind == "json_object":  # any object, compact like the schema case (no runs of whitespace)
        return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "choice":
        return xgr.Grammar.from_regex(choice_regex(value))
    return xgr.Grammar.from_ebnf(value)


@functools.lru_cache(maxsize=256)
def _check_compiles(key: str, where: str) -> None:
    """Parse the constraint into a grammar once per distinct constraint, so a 50k-line file that
    repeats one schema pays once; refusal names what the engine could not take."""
    try:
        grammar_of(json.loads(key))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{where} cannot be used for structured output: {native_message(exc)}") from None
