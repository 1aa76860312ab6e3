"""Incremental detokenisation with stop strings, one instance per sequence.

`tokenizers.decoders.DecodeStream` (primed with the prompt so the first output token gets its
leading space right) only yields text once a token completes valid UTF-8, so a streamed delta never
carries half a character. While a stop string could still be forming at the end of the text, that
tail is held back from the deltas; when a stop string appears the text is cut just before it.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
    ):
        self._tokenizer = tokenizer
        # The last few prompt tokens are enough context for spacing and multi-byte pieces.
        self._stream = DecodeStream(ids=prompt_token_ids[-8:], skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._num_emitted_chars = 0
        self.matched_stop: str | None = None

    def add_token(self, token_id: int) -> None:
        """Append one generated token; sets `matched_stop` and trims `text` if a stop string appears."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return
        search_from = max(0, len(self.text) - self._hold_back)
        self.text += piece
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[:at]
                self.matched_stop = stop
                return

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible partial stop string unless finished."""
        end = len(self.text) if finished or not self._stop else max(len(self.text) - self._hold_back, 0)
        end = max(end, self._num_emitted_chars)
        delta = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta
