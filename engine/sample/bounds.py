"""The bounds of every numeric sampling field, declared once.

SamplingParams.validate() checks them (the engine, the worker, `tokenloom run`) and the API's
request schema is built from them (api/openai/openai_schemas.py: its OpenAPI document and 422s), so the
two cannot disagree. The API may cap a field further for its own reasons (a request size limit);
it never widens one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenloom.engine.sample.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Bound:
    """low <= value <= high (either end open with `*_exclusive`, absent with None); integers only with `integer`."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    low_exclusive: bool = False

    def check(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            raise InvalidRequestError(f"{name} must be {'an integer' if self.integer else 'a number'}, got {value!r}")
        if not self.integer and math.isnan(value):
            raise InvalidRequestError(f"{name} must be a number, got {value}")
        below = self.low is not None and (value <= self.low if self.low_exclusive else value < self.low)
        above = self.high is not None and value > self.high
        if self.integer and (below or above):  # the one end it crossed: "n must be >= 1, got 0"
            side = f"{'>' if self.low_exclusive else '>='} {_number(self.low)}" if below else f"<= {_number(self.high)}"
            raise InvalidRequestError(f"{name} must be {side}, got {value}")
        if below or above:
            raise InvalidRequestError(f"{name} must be {self.describe()}, got {value}")

    def describe(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_exclusive else '>='} {_number(self.low)}"
        if self.low is None:
            return f"<= {_number(self.high)}"
        return f"in {'(' if self.low_exclusive else '['}{_number(self.low)}, {_number(self.high)}]"

    def schema_limits(self) -> dict[str, float]:
        """pydantic Field keywords (ge/gt/le) for the same bound."""
        limits: dict[str, float] = {}
        if self.low is not None:
            limits["gt" if self.low_exclusive else "ge"] = self.low
        if self.high is not None:
            limits["le"] = self.high
        return limits


def _number(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else str(value)


SAMPLING_BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(0, None, integer=True),  # 0: score the prompt (prompt_logprobs), generate nothing
    "temperature": Bound(0.0, 100.0),
    "top_p": Bound(0.0, 1.0, low_exclusive=True),
    "top_k": Bound(0, None, integer=True),  # -1 is accepted as 0 (disabled) before the check
    "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, 100.0, low_exclusive=True),
    "min_tokens": Bound(0, None, integer=True),
    "seed": Bound(-(2**63), 2**63 - 1, integer=True),
    "logprobs": Bound(0, 20, integer=True),
    "prompt_logprobs": Bound(0, 20, integer=True),
    "n": Bound(1, 128, integer=True),
}
LOGIT_BIAS_BOUND = Bound(-100.0, 100.0)  # each entry's additive bias
