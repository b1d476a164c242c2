"""The OpenAI-compatible HTTP API: the FastAPI application and its routes.

    GET  /v1/models                  the routes file's model ids
    GET  /v1/models/{model}
    POST /v1/completions             http/completions.py
    POST /v1/chat/completions        http/chat.py
    POST /v1/messages                Anthropic's Messages API over the chat path (http/messages.py)
    POST /v1/messages/count_tokens
    POST /v1/responses               http/responses.py (OpenAI's Responses API, stateless)
    GET  /health                     200 while some target of every model is healthy, else 503
    GET  /ready?model=ID             200 while some target of that model (every model without
                                     ?model=) is healthy, else 503; an unknown model is 404
    GET  /metrics                    Prometheus (services/gateway/metrics.py)
    GET  /openapi.json               the OpenAPI document (FastAPI's)
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.responses import Response

from services.gateway.http.chat import create_chat_completion
from services.gateway.http.completions import create_completion
from services.gateway.http.context import HttpContext
from services.gateway.http.errors import install_error_handlers
from services.gateway.http.messages import count_tokens, create_message
from services.gateway.http.middleware import GatewayMiddleware
from services.gateway.http.responses import create_response
from services.gateway.http.adapter_admin import load_lora_adapter, unload_lora_adapter
from services.gateway.http.models import list_models, retrieve_model
from services.gateway.http.protocol import ChatCompletion, Completion, ErrorResponse, Model, ModelList

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 413, 429, 503, 504)}
STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "data: {chunk} lines, then data: [DONE]"}}}
ANTHROPIC_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "Anthropic's events: "
                                                     "event: NAME and data: {json} lines"}}}


async def health(request: Request) -> JSONResponse:
    ctx: HttpContext = request.app.state.gateway
    down = [route.model for route in ctx.dispatcher.routes.values()
            if not any(t.healthy for t in route.node.leaves())]
    if down:
        return JSONResponse({"status": "unavailable", "models_without_targets": down}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request, model: str | None = None) -> JSONResponse:
    ctx: HttpContext = request.app.state.gateway
    routes = ctx.dispatcher.routes
    if model is not None and model not in routes:
        return JSONResponse({"status": "unknown_model", "model": model, "models": sorted(routes)}, status_code=404)
    names = [model] if model is not None else list(routes)
    healthy = {name: [t.name for t in routes[name].node.leaves() if t.healthy] for name in names}
    down = [name for name, targets in healthy.items() if not targets]
    body = {"status": "unavailable" if down else "ready", "healthy_targets": healthy}
    return JSONResponse(body, status_code=503 if down else 200)


async def metrics(request: Request) -> Response:
    ctx: HttpContext = request.app.state.gateway
    return Response(ctx.metrics.exposition(), media_type="text/plain; version=0.0.4")


def build_app(ctx: HttpContext) -> FastAPI:
    app = FastAPI(title="tokenmill gateway", version="1", description="OpenAI-compatible API routed over tokenmill "
                  "engines on their live latency profiles.", docs_url=None, redoc_url=None)
    app.state.gateway = ctx
    install_error_handlers(app)
    app.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList)
    app.add_api_route("/v1/models/{model}", retrieve_model, methods=["GET"], response_model=Model,
                      responses={404: {"model": ErrorResponse}})
    app.add_api_route("/v1/completions", create_completion, methods=["POST"], response_model=None,
                      responses={200: {"model": Completion, "content": STREAM}, **ERRORS})
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"], response_model=None,
                      responses={200: {"model": ChatCompletion, "content": STREAM}, **ERRORS})
    app.add_api_route("/v1/messages", create_message, methods=["POST"], response_model=None,
                      responses={200: {"content": ANTHROPIC_STREAM}, **ERRORS})
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"], response_model=None,
                      responses=ERRORS)
    app.add_api_route("/v1/responses", create_response, methods=["POST"], response_model=None,
                      responses={200: {"content": STREAM}, **ERRORS})
    app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"], response_model=None,
                      responses=ERRORS)
    app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"], response_model=None,
                      responses=ERRORS)
    app.add_api_route("/health", health, methods=["GET"], include_in_schema=True)
    app.add_api_route("/ready", ready, methods=["GET"], include_in_schema=True)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(GatewayMiddleware, max_request_bytes=ctx.max_request_bytes, metrics=ctx.metrics,
                       api_keys=ctx.api_keys, body_timeout_s=ctx.body_timeout_s)
    app.openapi = lambda: _openapi_with_models(app, sorted(ctx.dispatcher.routes))
    return app


def _openapi_with_models(app: FastAPI, models: list[str]) -> dict:
    """FastAPI's document, with the ``model`` fields listing this gateway's model ids."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            model = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {}).get("model")
            if model is not None:
                model["enum"] = models
        app.openapi_schema = schema
    return app.openapi_schema
