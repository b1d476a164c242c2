"""``GET /v1/models`` and ``GET /v1/models/{model}``: the model ids of the routes file."""

from __future__ import annotations

from fastapi import Request

from services.gateway.http.context import context_of
from services.gateway.http.errors import OpenAIError


def _model(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "tokenmill"}


async def list_models(request: Request) -> dict:
    ctx = context_of(request)
    return {"object": "list", "data": [_model(m, ctx.created) for m in ctx.dispatcher.routes]}


async def retrieve_model(model: str, request: Request) -> dict:
    ctx = context_of(request)
    if model not in ctx.dispatcher.routes:
        raise OpenAIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    return _model(model, ctx.created)
