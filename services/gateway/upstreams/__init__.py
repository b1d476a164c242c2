"""Targets that are not tokenmill engines: OpenAI-compatible and Anthropic Messages HTTP endpoints.

Each speaks the engines' Generation contract to the dispatcher (a GenerateRequest in, a stream of
Started / Delta / Finished out, failures as gRPC status codes), so every front end reaches them
through the one engine-request path: the translation happens here, at the edge.
"""

from __future__ import annotations

from services.gateway.routes_file import TargetSpec
from services.gateway.upstreams.anthropic import AnthropicDialect
from services.gateway.upstreams.client import HttpUpstream
from services.gateway.upstreams.openai import OpenAIDialect


def http_upstream(spec: TargetSpec) -> HttpUpstream:
    dialect = OpenAIDialect(spec.model, spec.stream_tools) if spec.kind == "openai" else AnthropicDialect(spec.model)
    return HttpUpstream(spec, dialect)
