"""Per-request sampling parameters: OpenAI's names plus vLLM's extensions.

`SamplingParams.validate()` checks every request-level bound, declared once in bounds.py (the
API's schema is built from the same table), so the offline runner, the worker and the API all
reject bad input with the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from tokenloom.engine.sample.bounds import LOGIT_BIAS_BOUND, SAMPLING_BOUNDS
from tokenloom.engine.sample.errors import InvalidRequestError

__all__ = ["InvalidRequestError", "SamplingParams"]


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the context limit, at most [sampling] max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token (0 = chosen only)
    # vLLM's: the logprob of each prompt token after the first, with this many top alternatives
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    # token id -> additive bias in [-100, 100] on its logit (OpenAI's logit_bias; -100 bans, 100 forces)
    logit_bias: dict[int, float] | None = None
    # a canonical constraint (engine/structured_output/spec.py): {"json": schema} | {"regex": ...} | ...
    structured_outputs: dict | None = None

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, values: dict, defaults: "SamplingParams | None" = None) -> "SamplingParams":
        """Build from a request body, with unset fields taken from `defaults` ([sampling]), and validate."""
        return cls.merged(values, defaults).validate()

    @classmethod
    def merged(cls, values: dict, defaults: "SamplingParams | None" = None) -> "SamplingParams":
        """`values` over `defaults`, in the fields' own shapes (a stop string as a list, -1 top_k as
        0, string token ids as ints), not yet validated: for a caller that hands the result to
        Engine.add_request, which validates it there (the worker, for requests the API checked)."""
        base = defaults if defaults is not None else cls()
        known = cls.field_names()
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        merged = {f.name: getattr(base, f.name) for f in fields(cls)}
        for name, value in values.items():
            if value is not None:
                merged[name] = value
        if isinstance(merged["stop"], str):
            merged["stop"] = [merged["stop"]]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(merged[name] or [], list):
                raise InvalidRequestError(f"{name} must be a list, got {type(merged[name]).__name__}")
            merged[name] = list(merged[name] or [])
        if merged["top_k"] == -1:
            merged["top_k"] = 0
        merged["logit_bias"] = _token_keyed(merged["logit_bias"])
        return cls(**merged)

    def validate(self) -> "SamplingParams":
        """Check every bound (InvalidRequestError names the field); returns these params with their
        structured-output constraint in canonical form, a new object where that differs. The
        object itself is never changed: it may be shared (the engine's defaults, a batch's params)."""
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if value is not None:  # max_tokens, seed and the logprobs fields may be unset
                bound.check(name, value)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequestError("skip_special_tokens must be true or false")
        if (
            not isinstance(self.stop, list)
            or len(self.stop) > 16
            or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise InvalidRequestError("stop must be a non-empty string or a list of at most 16 of them")
        self._validate_logit_bias()
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers")
        if self.structured_outputs is not None:
            from tokenloom.engine.structured_output.spec import canonical  # xgrammar loads only when used

            constraint = canonical(self.structured_outputs)
            if constraint != self.structured_outputs:
                return replace(self, structured_outputs=constraint)
        return self

    def check_token_ids(self, vocab_size: int) -> None:
        """The token ids the request names exist in a vocabulary of `vocab_size` (the engine's and
        the API's check, before anything is queued)."""
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {max(self.logit_bias)} is outside the vocabulary [0, {vocab_size})"
            )

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} token id -> bias entries"
            )
        for token_id, value in bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}"
                )
            LOGIT_BIAS_BOUND.check(f"logit_bias[{token_id}]", value)


MAX_LOGIT_BIAS_ENTRIES = 1024


def _token_keyed(bias):
    """JSON object keys are strings: {"50256": -100} -> {50256: -100.0}; anything else is left for
    validate() to refuse with its message."""
    if not isinstance(bias, dict):
        return bias
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        out[key] = float(value) if isinstance(value, int) and not isinstance(value, bool) else value
    return out
