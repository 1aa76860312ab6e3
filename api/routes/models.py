"""GET /v1/models: the one model this API's workers serve, in OpenAI's shape."""

from __future__ import annotations

from fastapi import APIRouter

from tokenloom.api.deps import Caller, State
from tokenloom.api.job_request import model_not_found
from tokenloom.api.served_model import ServedModel

router = APIRouter(prefix="/v1/models", tags=["models"])


def model_object(served: ServedModel) -> dict:
    return {
        "id": served.public_name,
        "object": "model",
        "created": served.created,
        "owned_by": "tokenloom",
        "max_model_len": served.max_model_len,
        "has_chat_template": served.has_chat_template,
    }


@router.get("")
async def list_models(state: State, _caller: Caller) -> dict:
    return {"object": "list", "data": [model_object(state.served)]}


@router.get("/{model:path}")
async def get_model(model: str, state: State, _caller: Caller) -> dict:
    if not state.served.answers_to(model):
        raise model_not_found(model, state.served)
    return model_object(state.served)
