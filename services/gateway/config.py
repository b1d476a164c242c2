"""Gateway service configuration: flags and TOKENMILL_GATEWAY_* environment variables.

The targets and routes are not flags: they live in the routes file (``--config``, see
services/gateway/routes_file.py). The ``--backend-tls-*`` flags are the TLS every target gets
unless its entry in the routes file has a ``tls`` of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.service_config import service_process_fields
from services.common.settings import setting
from services.gateway.api_keys import load_api_keys
from services.gateway.reasoning import PARSER_SETTINGS as REASONING_PARSER_SETTINGS
from services.gateway.http.tokens import TokenizerLoadError, TokenNamer
from services.gateway.routes_file import load_routes
from services.gateway.routing.build import build_route
from services.gateway.routing.target import TargetState
from services.gateway.tool_calls import PARSER_SETTINGS

DEFAULT_GRPC_PORT = 50050
DEFAULT_HTTP_PORT = 8000
MAX_PUBLIC_MESSAGE_BYTES = 16 * 1024 * 1024
"""As the scheduler's public API: a prompt of a million token ids is some 4 MiB."""


@dataclass
class GatewayServiceConfig(service_process_fields("gateway", DEFAULT_GRPC_PORT, MAX_PUBLIC_MESSAGE_BYTES,
                                                  backend_tls=True)):
    """tokenmill gateway: an OpenAI-compatible HTTP API and the Generation gRPC API in front of tokenmill
    engines, routing each request over them on their live latency profiles, its SLA and cost."""

    config: str = setting("", env="TOKENMILL_GATEWAY_CONFIG", path=True)
    """Routes file (YAML or JSON): the targets, and for each model id how to route it (required; see the README's
    Gateway section)."""
    http_port: int = setting(DEFAULT_HTTP_PORT, env="TOKENMILL_GATEWAY_HTTP_PORT")
    """OpenAI-compatible HTTP port (0 = any free port, -1 = no HTTP)."""
    http_port_file: str = setting("", path=True)
    """Write the bound HTTP port to this file once serving (empty = don't)."""
    profile_interval_s: float = setting(0.25, env="TOKENMILL_GATEWAY_PROFILE_INTERVAL_S")
    """How often each target's health and GetProfile are read, seconds; an unhealthy target is probed at the same
    pace."""
    profile_window_s: float = setting(10.0, env="TOKENMILL_GATEWAY_PROFILE_WINDOW_S")
    """The window GetProfile is asked for, seconds (short: the profile follows the live load)."""
    max_attempts: int = setting(3, env="TOKENMILL_GATEWAY_MAX_ATTEMPTS")
    """Targets one request may try: a failure before anything was streamed moves it to the next target of its route."""
    request_timeout_s: float = setting(600.0, env="TOKENMILL_GATEWAY_REQUEST_TIMEOUT_S")
    """A request still running after this long ends with 504 / DEADLINE_EXCEEDED."""
    http_header_timeout_s: float = setting(10.0, env="TOKENMILL_GATEWAY_HTTP_HEADER_TIMEOUT_S")
    """An HTTP connection whose request headers are not all in this long after it opened (or after its next request's
    first byte) is closed with 408."""
    http_body_timeout_s: float = setting(60.0, env="TOKENMILL_GATEWAY_HTTP_BODY_TIMEOUT_S")
    """An HTTP request body not all in this long after its headers gets 408."""
    http_max_header_bytes: int = setting(64 * 1024, env="TOKENMILL_GATEWAY_HTTP_MAX_HEADER_BYTES")
    """Largest request line and headers of an HTTP request, bytes; larger ones get 431."""
    http_max_connections: int = setting(4096, env="TOKENMILL_GATEWAY_HTTP_MAX_CONNECTIONS")
    """Most open HTTP connections; more are closed as they arrive (lowered with a warning when the open-file limit,
    ulimit -n, is short)."""
    http_keep_alive_s: float = setting(30.0, env="TOKENMILL_GATEWAY_HTTP_KEEP_ALIVE_S")
    """An idle HTTP connection is closed this long after its last answer."""
    max_request_bytes: int = setting(8 * 1024 * 1024, env="TOKENMILL_GATEWAY_MAX_REQUEST_BYTES")
    """Largest HTTP request body; larger ones get 413."""
    max_choices: int = setting(64, env="TOKENMILL_GATEWAY_MAX_CHOICES")
    """Most choices one request may ask for (n x prompts; each is one engine call)."""
    api_keys_file: str = setting("", env="TOKENMILL_GATEWAY_API_KEYS_FILE", path=True)
    """JSON list of the gateway's API keys, each naming a tenant ({"key", "tenant"}, optional models,
    max_concurrent_requests, cache_group, max_priority, requests_per_minute, tokens_per_minute): every request then
    needs one, and each tenant's prefix cache is its own; empty = keyless, the client's Authorization goes to the
    engines (see services/gateway/api_keys.py)."""
    tool_call_parser: str = setting("auto", env="TOKENMILL_GATEWAY_TOOL_CALL_PARSER")
    """How tool_choice auto reads tool calls out of a reply: auto (the format the serving engine's chat template
    defines, text when none), none (text), hermes, llama3_json or mistral; a route's tool_call_parser overrides it."""
    reasoning_parser: str = setting("none", env="TOKENMILL_GATEWAY_REASONING_PARSER")
    """How chat replies' reasoning is read out to reasoning_content: none (the reply is content), deepseek_r1 (the
    template opens <think>: the reply starts inside it) or qwen3 (reasoning when the reply opens <think>); a
    route's reasoning_parser overrides it."""

    def validate(self) -> None:
        """The numbers, and the routes file read and built (every route's targets exist, every
        route's tokenizer loads)."""
        if not self.config:
            raise ValueError("config: a routes file is required (--config FILE or TOKENMILL_GATEWAY_CONFIG)")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [-1, 65535], got {self.http_port}")
        for name in ("profile_interval_s", "profile_window_s", "request_timeout_s", "http_header_timeout_s",
                     "http_body_timeout_s", "http_keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_attempts", "max_choices", "max_request_bytes", "http_max_header_bytes",
                     "http_max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_call_parser not in PARSER_SETTINGS:
            raise ValueError(f"tool_call_parser must be one of {list(PARSER_SETTINGS)}, got {self.tool_call_parser!r}")
        if self.api_keys_file:
            load_api_keys(self.api_keys_file)
        if self.reasoning_parser not in REASONING_PARSER_SETTINGS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSER_SETTINGS)}, "
                             f"got {self.reasoning_parser!r}")
        routes = load_routes(self.config)
        states = {t.name: TargetState(t.name) for t in routes.targets}
        for model in routes.models.values():
            build_route(model, states, where=f"routes file {self.config}: models.{model.name}.route")
        token_namers(routes.models, self.config)


def token_namers(models, origin: str) -> dict[str, TokenNamer]:
    """The token namer of every model whose route names a tokenizer, loaded now: a tokenizer that does
    not load is the routes file's fault, reported at start (ValueError naming the entry), never as
    the answer to a request."""
    namers = {}
    for model in models.values():
        if model.tokenizer:
            try:
                namers[model.name] = TokenNamer(model.tokenizer)
            except TokenizerLoadError as exc:
                raise ValueError(f"routes file {origin}: models.{model.name}.tokenizer: {exc}") from None
    return namers
