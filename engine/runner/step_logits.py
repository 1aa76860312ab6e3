"""What one forward pass hands back: the sampled chunks' logits, and the final hidden states of the
positions that score a prompt (prompt logprobs), whose logits are computed later a slice at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepLogits:
    """`sampled` [num_sampled, vocab] float32, one row per sampled chunk in plan order, VALID UNTIL
    THE NEXT FORWARD (the runner reuses its buffer). `scored_hidden` [num_scored, hidden] (or None):
    one row per position scoring a prompt, chunk by chunk in plan order, positions ascending.
    `lm_head` maps hidden rows to their logits (the model's head, soft-capping included)."""

    sampled: torch.Tensor
    scored_hidden: torch.Tensor | None
    lm_head: Callable[[torch.Tensor], torch.Tensor]

    def clone(self) -> StepLogits:
        hidden = None if self.scored_hidden is None else self.scored_hidden.clone()
        return StepLogits(self.sampled.clone(), hidden, self.lm_head)

    @staticmethod
    def concat(parts: list[StepLogits]) -> StepLogits | None:
        """Several forwards' outputs as one step's (each part's rows in the parts' order)."""
        if not parts:
            return None
        hidden = [p.scored_hidden for p in parts if p.scored_hidden is not None]
        return StepLogits(
            torch.cat([p.sampled for p in parts]), torch.cat(hidden) if hidden else None, parts[0].lm_head
        )
