"""Engine logprobs (token ids) -> the stored per-token entries that OpenAI's shapes are built from.

The worker (at finish and with each streamed delta) and `tokenloom run` (per result line) store
what a client needs, so nothing downstream needs a tokenizer. One entry per generated token,
aligned with the choice's `token_ids`:

    {"token_id": 42, "token": " time", "bytes": [32, 116, 105, 109, 101], "logprob": -1.25,
     "top": [[42, -1.25], [7, -2.5]],                       # top alternatives, highest first
     "top_tokens": [{"token": " time", "bytes": [...]}, {"token": "s", "bytes": [115]}]}

`top` keeps the [id, logprob] pairs result lines always had; `top_tokens` spells them, in the same
order. `logprob` is null where the float is not finite (JSON has no -Infinity).

How a token is spelled:
- `token` is the token's text as a continuation of earlier text (engine/outputs/detokenizer.py: a
  SentencePiece "▁time" reads " time"), special tokens included ("</s>");
- `bytes` are the token's real UTF-8 bytes: a byte-fallback piece "<0xE2>" is [0xE2] and a
  byte-level BPE piece is its bytes, even when they are only part of a character (its `token`
  then reads U+FFFD, as the decoded text does). Concatenating `bytes` gives the text's bytes.
"""

from __future__ import annotations

import json
import math
import re
import weakref

from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tokenloom.engine.outputs.detokenizer import IncrementalDetokenizer
from tokenloom.engine.sample.sampler import TokenLogprobs

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# GPT-2's byte-level alphabet: each byte is written as one printable character in the vocabulary.
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class TokenSpeller:
    """Token id -> (text, UTF-8 bytes) for one tokenizer; each id is spelled once and remembered."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._special = {token_id: added.content for token_id, added in tokenizer.get_added_tokens_decoder().items()}
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
        self._byte_level = _uses_decoder(decoder, "ByteLevel")
        self._byte_fallback = _uses_decoder(decoder, "ByteFallback")
        self._spelled: dict[int, tuple[str, list[int]]] = {}  # at most one entry per vocabulary id

    def spell(self, token_id: int) -> tuple[str, list[int]]:
        spelled = self._spelled.get(token_id)
        if spelled is None:
            spelled = self._spelled[token_id] = self._spell(token_id)
        return spelled

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        if token_id in self._special:
            text = self._special[token_id]
            return text, list(text.encode("utf-8"))
        detokenizer = IncrementalDetokenizer(self._tokenizer, [], skip_special_tokens=False)
        detokenizer.add_token(token_id)
        text = detokenizer.text
        piece = self._tokenizer.id_to_token(token_id)
        if piece is not None and self._byte_fallback and (byte := _BYTE_PIECE.fullmatch(piece)):
            return text, [int(byte.group(1), 16)]
        if piece is not None and self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return text, [_BYTE_OF_CHAR[c] for c in piece]
        return text, list(text.encode("utf-8"))

    def entry(self, logprobs: TokenLogprobs) -> dict:
        """One stored entry (the shape in the module docstring)."""
        token, token_bytes = self.spell(logprobs.token_id)
        top_tokens = []
        for alternative_id, _ in logprobs.top:
            text, alternative_bytes = self.spell(alternative_id)
            top_tokens.append({"token": text, "bytes": alternative_bytes})
        return {
            "token_id": logprobs.token_id,
            "token": token,
            "bytes": token_bytes,
            "logprob": finite(logprobs.logprob),
            "top": [[alternative_id, finite(lp)] for alternative_id, lp in logprobs.top],
            "top_tokens": top_tokens,
        }

    def entries(self, logprobs: list[TokenLogprobs] | None) -> list[dict] | None:
        return None if logprobs is None else [self.entry(lp) for lp in logprobs]

    def prompt_entries(self, prompt_ids: list[int], logprobs: list[TokenLogprobs | None] | None) -> list[dict] | None:
        """Stored entries of a request's prompt logprobs: the first token (which nothing predicts) is
        spelled with `logprob` and `top` null, as OpenAI's echo shows it; so is a position the engine
        never scored (a request aborted while its prompt was still being prefilled)."""
        if logprobs is None:
            return None
        return [
            self.entry(lp) if lp is not None and position > 0 else self._unscored_entry(token_id)
            for position, (token_id, lp) in enumerate(zip(prompt_ids, logprobs, strict=True))
        ]

    def _unscored_entry(self, token_id: int) -> dict:
        token, token_bytes = self.spell(token_id)
        return {
            "token_id": token_id,
            "token": token,
            "bytes": token_bytes,
            "logprob": None,
            "top": None,
            "top_tokens": None,
        }


_spellers: "weakref.WeakKeyDictionary[Tokenizer, TokenSpeller]" = weakref.WeakKeyDictionary()


def speller_for(tokenizer: Tokenizer) -> TokenSpeller:
    """The tokenizer's one speller (its spelled ids are shared by every caller)."""
    speller = _spellers.get(tokenizer)
    if speller is None:
        speller = _spellers[tokenizer] = TokenSpeller(tokenizer)
    return speller


def finite(value: float | None) -> float | None:
    """JSON has no NaN/Infinity: None instead."""
    return value if value is None or math.isfinite(value) else None


def _uses_decoder(decoder: dict, kind: str) -> bool:
    """Whether the tokenizer.json decoder (possibly a Sequence of decoders) contains `kind`."""
    if decoder.get("type") == kind:
        return True
    return any(_uses_decoder(step, kind) for step in decoder.get("decoders") or [])
