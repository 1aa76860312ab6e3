"""What the API knows about the model its workers serve, without loading any weights.

The tokenizer (and chat template) and the context limit come from the same checkpoint and
`[model]` keys the worker uses, so the API can refuse a prompt that cannot run (too long, chat
without a template) with a 400 instead of queueing a job that is bound to fail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.engine import (
    InvalidRequestError,
    PromptEncoder,
    SamplingParams,
    default_cache_dir,
    demo_model,
    fit_to_context,
    load_hf_config,
    resolve_checkpoint,
)
from tokenloom.engine.config import ModelConfig, SamplingDefaults
from tokenloom.openai_protocol.scoring_limit import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES

DEMO_NAME = "tokenloom-demo"  # what the worker calls the built-in demo model (engine/runner/model_setup.py)


@dataclass(slots=True)
class ServedModel:
    name: str  # what requests must call it: [model] name, or "tokenloom-demo"
    encoder: PromptEncoder
    max_model_len: int
    sampling: SamplingDefaults  # [sampling]: the worker's defaults for unset fields
    alias: str = ""  # [model] served_name: the name clients use (GET /v1/models shows it)
    vocab_size: int | None = None  # the model's embedding rows: valid token ids (as the engine checks)
    strict_fields: bool = False  # [server] strict_fields: refuse request fields tokenloom does not define
    # [server] max_prompt_logprob_entries: prompt logprobs one request may ask for (openai_protocol/scoring_limit.py)
    max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def public_name(self) -> str:
        return self.alias or self.name

    @classmethod
    def load(cls, model: ModelConfig, sampling: SamplingDefaults) -> "ServedModel":
        # The worker's own rule (engine/runner/model_setup.py), so both read the same converted
        # GGUF checkpoint or demo model from the cache.
        cache_dir = default_cache_dir()
        checkpoint = (
            demo_model(cache_dir, model.demo).checkpoint
            if not model.name
            else resolve_checkpoint(model.name, cache_dir)
        )
        tokenizer_path = resolve_checkpoint(model.tokenizer, cache_dir) if model.tokenizer else checkpoint
        encoder = PromptEncoder.load(tokenizer_path, model.chat_template)
        hf_config = load_hf_config(Path(checkpoint))
        limit = model.max_model_len or hf_config.max_position_embeddings
        return cls(
            model.name or DEMO_NAME,
            encoder,
            limit,
            sampling,
            alias=model.served_name,
            vocab_size=getattr(hf_config, "vocab_size", None),
        )

    @property
    def has_chat_template(self) -> bool:
        return self.encoder.chat_template is not None

    def answers_to(self, requested: str | None) -> bool:
        """[model] served_name, the configured name, or its last path component (a directory's name)."""
        if requested is None:
            return True
        return requested in (self.name, self.name.rstrip("/").rsplit("/", 1)[-1]) or bool(
            self.alias and requested == self.alias
        )

    def encode(self, prompt: str | list[int] | None, messages: list | None) -> list[int]:
        """The engine's own encoding rule (PromptEncoder.encode_prompt), with the fix for a model
        without a chat template spelled for the API's operator."""
        if messages is not None and not self.has_chat_template:
            raise InvalidRequestError(
                f"model {self.name!r} has no chat template, so 'messages' cannot be used: set [model] "
                "chat_template to a Jinja template file (for the API and the worker), or call "
                "POST /v1/completions with a 'prompt'"
            )
        return self.encoder.encode_prompt(prompt, messages, self.vocab_size or len(self.encoder.tokenizer))

    def check_fits(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """The engine's context checks, made before the job is queued."""
        fit_to_context(params, num_prompt_tokens, self.max_model_len, self.sampling.max_tokens)
        params.check_token_ids(self.vocab_size or len(self.encoder.tokenizer))
