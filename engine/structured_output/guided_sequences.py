"""The engine's constrained sequences: one grammar matcher per sequence, one token bitmask per step.

Each step the engine asks for the bitmask of the sequences it is about to sample (`fill_bitmask`,
one xgrammar batch call over all of them); the sampler masks their logits with it; each sampled
token is then fed to its matcher (`accept`). A matcher follows its sequence's tokens, which
preemption keeps (recompute re-prefills them, swap restores their KV), so a preempted sequence
resumes with its matcher where it was: nothing is rolled back because no accepted token is ever
taken back. Sequences without a constraint cost nothing: nothing here runs for a step without one.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from tokenloom.engine.sample.sampler import TokenConstraint
from tokenloom.engine.sample.sampling_params import InvalidRequestError
from tokenloom.engine.structured_output.spec import grammar_of, native_message

if TYPE_CHECKING:  # xgrammar is imported when the first constrained request comes (import cost)
    from xgrammar import CompiledGrammar, GrammarMatcher

COMPILED_CACHE_SIZE = 128  # distinct constraints kept compiled (a batch usually repeats one schema)


class GuidedSequences:
    """Matchers of the constrained sequences in flight; built on the first constrained request."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._matchers: dict[int, GrammarMatcher] = {}
        self._batch = xgr.BatchGrammarMatcher()

    def compile(self, constraint: dict) -> CompiledGrammar:
        """The constraint compiled for this vocabulary (cached); InvalidRequestError if it cannot be."""
        key = json.dumps(constraint, sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled = self._compiler.compile_grammar(grammar_of(constraint))
            except (RuntimeError, ValueError, TypeError) as exc:
                raise InvalidRequestError(f"structured output cannot be compiled: {native_message(exc)}") from None
            self._compiled[key] = compiled
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return compiled

    def add(self, seq_id: int, compiled: CompiledGrammar) -> None:
        self._matchers[seq_id] = self._xgr.GrammarMatcher(compiled)

    def remove(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def fill_bitmask(self, seq_ids: list[int]) -> torch.Tensor:
        """int32 [len(seq_ids), ceil(vocab / 32)]: bit t of row i set = token t allowed for seq_ids[i]."""
        bitmask = self._xgr.allocate_token_bitmask(len(seq_ids), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([self._matchers[s] for s in seq_ids], bitmask)
        return bitmask

    def constraint(self, seq_ids: list[int]) -> TokenConstraint | None:
        """The step's bitmask over the rows of `seq_ids` (a step's sampled sequences, in row order)
        that are constrained; None when none is."""
        rows = [i for i, seq_id in enumerate(seq_ids) if seq_id in self._matchers]
        if not rows:
            return None
        return TokenConstraint(rows, self.fill_bitmask([seq_ids[i] for i in rows]))

    def advance(self, seq_id: int, token_id: int) -> bool:
        """Feed a sequence's sampled token to its matcher: True once its constraint is complete,
        False for an unconstrained sequence; InvalidRequestError if the grammar refuses the token."""
        if seq_id not in self._matchers:
            return False
        if not self.accept(seq_id, token_id):
            raise InvalidRequestError(
                f"structured output: token {token_id} is not allowed by the constraint (min_tokens, "
                "ignore_eos or logit_bias can contradict it)"
            )
        return self.is_terminated(seq_id)

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance the sequence's matcher by its sampled token; False if the grammar refuses it."""
        return self._matchers[seq_id].accept_token(token_id)

    def is_terminated(self, seq_id: int) -> bool:
        return self._matchers[seq_id].is_terminated()
