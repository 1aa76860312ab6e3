"""Incremental detokenisation with stop strings, one instance per sequence; it never raises on any ids.

What the text is (token ids are the truth, the text is a function of them):

    decoded(ids) = tokenizer.decode([a] + ids, skip_special_tokens)[len(tokenizer.decode([a])):]

where `tokenizer` is the checkpoint's `tokenizers.Tokenizer` and `a` is one fixed ordinary vocabulary
token (normally the one-character token "a"; chosen once per tokenizer). That is `tokenizer.decode(ids)`
read as a continuation of earlier text: a SentencePiece/Metaspace tokenizer drops the leading space
of the first token of a decode, and the anchor `a` keeps it, so "▁time" after a prompt reads " time".
The prompt itself plays no part. `tokenizer.decode` is
the `tokenizers` decode, which is what transformers' `decode` returns when
clean_up_tokenization_spaces is off. Byte tokens that never form valid UTF-8 come out as U+FFFD exactly
as `tokenizer.decode` renders them. Without stop strings the final text is decoded(output ids).
With stop strings, generation conceptually ends at the first token k after which decoded(ids[:k])
contains a stop string; the text is decoded(ids[:k]) cut just before the earliest occurrence
(ties: the stop listed first), `matched_stop` is that string, and later tokens (generated only when
min_tokens forces the engine on) leave the text alone.

How it stays cheap: the committed text (`_settled`) only ever grows; the ids after it (`_pending_ids`)
are re-decoded, behind the anchor, on every token. Pending ids are committed once their text can no
longer change whatever comes next: it does not end in U+FFFD (a possibly incomplete multi-byte
character) and the last id the decoder sees is not a byte-fallback piece "<0xNN>" (the ByteFallback
decoder turns a whole run of byte pieces into U+FFFD if any byte of the run is invalid, so an open run
can still change). The window is therefore a few ids, or one run of byte pieces. A tokenizer with no
usable anchor token (none of the BPE/SentencePiece LLM tokenizers) decodes each window on its own,
which can drop a space where a window starts.

`text` is always what the final text would be if the sequence finished now; its last characters can
still change while ids arrive (an incomplete character). `take_delta` only hands out settled text,
minus the tail where a stop string could still be forming, until the sequence finishes; so the
concatenated deltas equal the final text.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from tokenizers import Tokenizer

# Single characters tried first as the decode anchor; any ordinary vocabulary token qualifies.
_ANCHOR_PIECES = ("a", "e", "t", "x", "A", "0", ".", ",")
# A tokenizer with no candidate among these is scanned this far into its vocabulary.
_ANCHOR_SCAN_LIMIT = 4096
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class _DecodeProfile:
    """What the detokenizer needs to know about one tokenizer, computed once per tokenizer."""

    anchor_id: int | None  # None: no usable anchor, so a leading space may be dropped as in a plain decode
    anchor_text: str
    byte_piece_ids: frozenset[int]  # "<0x00>".."<0xFF>" pieces, joined into runs by the ByteFallback decoder
    special_ids: frozenset[int]  # dropped before decoding when skip_special_tokens is set


_profiles: "weakref.WeakKeyDictionary[Tokenizer, _DecodeProfile]" = weakref.WeakKeyDictionary()


def _profile(tokenizer: Tokenizer) -> _DecodeProfile:
    profile = _profiles.get(tokenizer)
    if profile is None:
        profile = _build_profile(tokenizer)
        _profiles[tokenizer] = profile
    return profile


def _build_profile(tokenizer: Tokenizer) -> _DecodeProfile:
    byte_piece_ids = frozenset(
        token_id for byte in range(256) if (token_id := tokenizer.token_to_id(f"<0x{byte:02X}>")) is not None
    )
    special_ids = frozenset(
        token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
    )
    anchor_id, anchor_text = _find_anchor(tokenizer, byte_piece_ids | special_ids)
    return _DecodeProfile(anchor_id, anchor_text, byte_piece_ids, special_ids)


def _find_anchor(tokenizer: Tokenizer, excluded: frozenset[int]) -> tuple[int | None, str]:
    candidates = [tokenizer.token_to_id(piece) for piece in _ANCHOR_PIECES]
    candidates += range(min(tokenizer.get_vocab_size(), _ANCHOR_SCAN_LIMIT))
    for token_id in candidates:
        if token_id is None or token_id in excluded:
            continue
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        # It must decode on its own to visible text that later tokens cannot merge into or strip:
        # decoding it twice gives its text twice.
        if (
            text
            and not text[0].isspace()
            and _REPLACEMENT_CHAR not in text
            and tokenizer.decode([token_id], skip_special_tokens=True) == text
            and tokenizer.decode([token_id, token_id], skip_special_tokens=False) == text + text
        ):
            return token_id, text
    return None, ""


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        skip_special_tokens: bool,
    ):
        self._tokenizer = tokenizer
        self._profile = _profile(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        # A stop string may start this many characters before the end of the settled text.
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self._settled = ""
        self._pending_ids: list[int] = []
        self._num_emitted_chars = 0
        self.text = ""
        self.matched_stop: str | None = None

    def add_token(self, token_id: int) -> None:
        """Append one generated token; sets `matched_stop` and trims `text` if a stop string appears."""
        if self.matched_stop is not None:
            return
        # Occurrences lying wholly inside the settled text were looked for when it settled.
        search_from = max(0, len(self._settled) - self._hold_back)
        self._pending_ids.append(int(token_id))
        pending_text, settled = self._decode_pending()
        if settled:
            self._settled += pending_text
            self._pending_ids.clear()
            pending_text = ""
        self.text = self._settled + pending_text
        self._cut_at_first_stop(search_from)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; until finished, only text that can no longer change or be cut."""
        if finished or self.matched_stop is not None:
            end = len(self.text)
        else:
            end = len(self._settled) - self._hold_back
        end = max(end, self._num_emitted_chars)
        delta = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta

    def _decode_pending(self) -> tuple[str, bool]:
        """The pending ids' text, and whether it is settled (no later id can change it)."""
        profile = self._profile
        ids = self._pending_ids if profile.anchor_id is None else [profile.anchor_id, *self._pending_ids]
        decoded = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        text = decoded[len(profile.anchor_text) :]
        settled = (
            decoded.startswith(profile.anchor_text)
            and not text.endswith(_REPLACEMENT_CHAR)
            and not self._ends_in_byte_run()
        )
        return text, settled

    def _ends_in_byte_run(self) -> bool:
        profile = self._profile
        for token_id in reversed(self._pending_ids):
            if token_id in profile.byte_piece_ids:
                return True
            # Ids the decode drops (skipped specials, ids past the vocabulary) join the bytes around them.
            skipped = self._skip_special_tokens and token_id in profile.special_ids
            if not skipped and self._tokenizer.id_to_token(token_id) is not None:
                return False
        return False

    def _cut_at_first_stop(self, search_from: int) -> None:
        first: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.text = self.text[: first[0]]
            self.matched_stop = first[1]
