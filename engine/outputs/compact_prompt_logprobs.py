"""A request's prompt logprobs as stored: one column per field, each token spelled once.

A scoring request asks for a logprob (and top alternatives) at every prompt position: a 100k-token
prompt is 100k entries. Written as the per-token entries clients get (engine/outputs/
logprob_tokens.py) each position repeats its keys and spells its token and every alternative
(text and a list of bytes), several times the numbers themselves. Stored compactly instead:

    {"format": "tokenloom.prompt_logprobs.v1",
     "token_ids": [1, 42, ...],                    # the prompt
     "logprobs": [null, -1.25, ...],               # null: unscored (the first token) or not finite
     "top": [null, [[42, -1.25], [7, -2.5]], ...], # null: unscored; else the alternatives, best first
     "spelling": {"42": [" time", [32, 116, 105, 109, 101]], ...}}   # each id seen, once

and expanded into the client's entries only when a response needs them (`expand_prompt_logprobs`),
with no tokenizer: the spelling travels with the numbers. Rows stored as entry lists (before this
format) are returned as they are.
"""

from __future__ import annotations

from typing import Any

from tokenloom.engine.outputs.logprob_tokens import TokenSpeller, finite
from tokenloom.engine.sample.sampler import TokenLogprobs

COMPACT_FORMAT = "tokenloom.prompt_logprobs.v1"


def compact_prompt_logprobs(
    speller: TokenSpeller, prompt_ids: list[int], logprobs: list[TokenLogprobs | None] | None
) -> dict[str, Any] | None:
    """The stored form of a request's prompt logprobs (None when it asked for none). Position 0, which
    nothing predicts, and positions never scored (aborted mid-prefill) keep `logprobs` and `top` null."""
    if logprobs is None:
        return None
    values: list[float | None] = []
    tops: list[list[list[float | int | None]] | None] = []
    spelling: dict[str, list[Any]] = {}

    def spell(token_id: int) -> None:
        key = str(token_id)
        if key not in spelling:
            text, token_bytes = speller.spell(token_id)
            spelling[key] = [text, token_bytes]

    for position, (token_id, lp) in enumerate(zip(prompt_ids, logprobs, strict=True)):
        spell(token_id)
        if lp is None or position == 0:
            values.append(None)
            tops.append(None)
            continue
        values.append(finite(lp.logprob))
        tops.append([[alternative_id, finite(alternative_lp)] for alternative_id, alternative_lp in lp.top])
        for alternative_id, _ in lp.top:
            spell(alternative_id)
    return {
        "format": COMPACT_FORMAT,
        "token_ids": list(prompt_ids),
        "logprobs": values,
        "top": tops,
        "spelling": spelling,
    }


def expand_prompt_logprobs(stored: dict[str, Any] | list[dict] | None) -> list[dict] | None:
    """The per-token entries clients get (engine/outputs/logprob_tokens.py's shape) of a stored value."""
    if stored is None or isinstance(stored, list):
        return stored
    if stored.get("format") != COMPACT_FORMAT:
        raise ValueError(f"unknown stored prompt logprobs format {stored.get('format')!r}")
    spelling = stored["spelling"]

    def spelled(token_id: int) -> dict[str, Any]:
        text, token_bytes = spelling[str(token_id)]
        return {"token": text, "bytes": token_bytes}

    entries = []
    for token_id, value, top in zip(stored["token_ids"], stored["logprobs"], stored["top"], strict=True):
        entry: dict[str, Any] = {"token_id": token_id, **spelled(token_id), "logprob": value}
        if top is None:
            entry.update(top=None, top_tokens=None)
        else:
            entry.update(top=top, top_tokens=[spelled(alternative_id) for alternative_id, _ in top])
        entries.append(entry)
    return entries
