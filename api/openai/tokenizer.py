"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the served model's tokenizer over HTTP,
in vLLM's shapes (at the server's root, as vLLM serves them), so that a client scoring or
evaluating through the API (lm-evaluation-harness's `tokenizer_backend=remote`) counts and
splits tokens exactly as the worker does, without a copy of the checkpoint. Authenticated like
every other route."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from tokenloom.api.deps import Caller, State
from tokenloom.api.errors import ApiError
from tokenloom.api.job_request import check_model
from tokenloom.api.openai.openai_schemas import MAX_PROMPT_TOKEN_IDS, Messages
from tokenloom.api.served_model import ServedModel
from tokenloom.engine import InvalidRequestError

router = APIRouter(tags=["tokenizer"])


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = Field(None, description="text to tokenize (or `messages`)")
    messages: Messages | None = Field(None, description="chat messages, through the model's chat template")
    add_special_tokens: StrictBool | None = Field(
        None,
        description="add the tokenizer's special tokens (BOS...); default true for `prompt`, false for "
        "`messages` (the template writes its own)",
    )
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State, _caller: Caller) -> Response:
    # On a thread: a prompt of max_body_mb takes seconds to tokenize, and the event loop serves every request.
    return await run_in_threadpool(lambda: json_response(_tokenize(body, state.served)))


def _tokenize(body: TokenizeRequest, served: ServedModel) -> dict:
    check_model(body.model, served)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of 'prompt' (text) and 'messages' (chat)", param="prompt")
    tokenizer = served.encoder.tokenizer
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = list(tokenizer(body.prompt, add_special_tokens=add_special).input_ids)
    else:
        if not served.has_chat_template:
            raise ApiError(
                400,
                f"model {served.name!r} has no chat template: tokenize a 'prompt' instead, or set "
                "[model] chat_template",
                param="messages",
            )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            tokens = served.encoder.encode_messages(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                add_special_tokens=bool(body.add_special_tokens),
            )
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="messages") from None
    return {
        "count": len(tokens),
        "max_model_len": served.max_model_len,
        "tokens": tokens,
        "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State, _caller: Caller) -> Response:
    return await run_in_threadpool(lambda: json_response(_detokenize(body, state.served)))


def _detokenize(body: DetokenizeRequest, served: ServedModel) -> dict:
    check_model(body.model, served)
    vocab_size = served.vocab_size or len(served.encoder.tokenizer)
    outside = [t for t in body.tokens if t >= vocab_size]
    if outside:
        raise ApiError(
            400, f"token id {outside[0]} is outside the vocabulary (ids are in [0, {vocab_size}))", param="tokens"
        )
    return {"prompt": served.encoder.decode(body.tokens, skip_special_tokens=False)}


def json_response(body: dict) -> Response:
    """`body` as JSON, encoded on the caller's thread (a million token ids or strings is no small string)."""
    return Response(json.dumps(body, ensure_ascii=False, separators=(",", ":")), media_type="application/json")


@router.get("/tokenizer_info")
async def tokenizer_info(state: State, _caller: Caller) -> dict:
    """The tokenizer's special tokens, chat template and the served context length."""
    served = state.served
    tokenizer = served.encoder.tokenizer
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "chat_template": served.encoder.chat_template,
        "model_max_length": served.max_model_len,
        "vocab_size": served.vocab_size or len(tokenizer),
    }
