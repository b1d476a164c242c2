"""``GET /v1/models`` and ``GET /v1/models/{model}``: the model ids of the routes file, and the
LoRA adapters their engines serve, each with its base model as ``parent`` (as vLLM lists them).
With API keys, a key sees only the adapters it may use (api_keys.py)."""

from __future__ import annotations

from fastapi import Request

from services.gateway.http.context import api_key_of, context_of
from services.gateway.http.errors import OpenAIError


def _model(model_id: str, created: int, parent: str | None = None) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "tokenmill", "root": model_id,
            "parent": parent}


def _visible(request: Request) -> dict[str, str | None]:
    """Each model id the caller may see -> its parent (None for a routes-file model)."""
    ctx = context_of(request)
    key = api_key_of(request)
    models: dict[str, str | None] = dict.fromkeys(ctx.dispatcher.routes)
    for adapter, parent in sorted(ctx.dispatcher.adapters().items()):
        if key is None or key.may_use_adapter(adapter):
            models[adapter] = parent
    return models


async def list_models(request: Request) -> dict:
    created = context_of(request).created
    return {"object": "list", "data": [_model(m, created, parent) for m, parent in _visible(request).items()]}


async def retrieve_model(model: str, request: Request) -> dict:
    models = _visible(request)
    if model not in models:
        raise OpenAIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    return _model(model, context_of(request).created, models[model])
