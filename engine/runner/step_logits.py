"""The logits one forward pass hands back: the sampled chunks' rows, then the prompt-scoring rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepLogits:
    """`rows` [num_sampled + num_scored, vocab] float32, VALID UNTIL THE NEXT FORWARD (the runner
    reuses its buffer): first one row per sampled chunk in plan order, then one row per position
    that scores a prompt, chunk by chunk in plan order, positions ascending."""

    rows: torch.Tensor
    num_sampled: int

    @property
    def sampled(self) -> torch.Tensor:
        return self.rows[: self.num_sampled]

    @property
    def scored(self) -> torch.Tensor:
        return self.rows[self.num_sampled :]

    def clone(self) -> StepLogits:
        return StepLogits(self.rows.clone(), self.num_sampled)

    @staticmethod
    def concat(parts: list[StepLogits]) -> StepLogits | None:
        """Several forwards' logits as one step's (sampled rows of all first, then scored rows)."""
        if not parts:
            return None
        rows = torch.cat([p.sampled for p in parts] + [p.scored for p in parts])
        return StepLogits(rows, sum(p.num_sampled for p in parts))
