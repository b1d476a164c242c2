"""What the HTTP handlers share: the dispatcher, the limits, the token namers of the routes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from fastapi import Request

from services.gateway.api_keys import ApiKey, ApiKeys
from services.gateway.dispatch import Dispatcher
from services.gateway.http.tokens import TokenNamer
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing.build import Route

MAX_REQUEST_ID_CHARS = 200
"""The engine allows 256 characters; choices append "-N"."""


@dataclass
class HttpContext:
    dispatcher: Dispatcher
    metrics: GatewayMetrics
    timeout_s: float = 600.0
    max_choices: int = 64
    max_request_bytes: int = 8 * 1024 * 1024
    created: int = 0
    """Unix time the gateway started: the models' ``created``."""
    tool_call_parser: str = "auto"
    """GatewayServiceConfig.tool_call_parser (http/auto_tools.py)."""
    body_timeout_s: float = 60.0
    """GatewayServiceConfig.http_body_timeout_s (middleware.py)."""
    api_keys: ApiKeys | None = None
    """The gateway's API keys (api_keys.py); None = keyless."""
    reasoning_parser: str = "none"
    """GatewayServiceConfig.reasoning_parser (services/gateway/reasoning)."""
    namers: dict[str, TokenNamer] = field(default_factory=dict)
    """Each model's token namer, loaded at start (config.token_namers); others are made on first use."""

    def namer(self, route: Route) -> TokenNamer:
        namer = self.namers.get(route.model)
        if namer is None:
            namer = self.namers[route.model] = TokenNamer(route.tokenizer)
        return namer


def context_of(request: Request) -> HttpContext:
    return request.app.state.gateway


def request_id_of(request: Request) -> str:
    """The X-Request-Id the middleware settled on (the client's, or a new one)."""
    rid = request.scope.get("state", {}).get("request_id")
    return rid or uuid.uuid4().hex


def api_key_of(request: Request) -> ApiKey | None:
    """The API key the middleware authenticated (None: the gateway is keyless)."""
    return request.scope.get("state", {}).get("api_key")
