"""The gateway's one intake: what routing sees of a request, built once for HTTP and gRPC.

Each front end reads its own body (OpenAI JSON, Anthropic's and the Responses API through the
chat path, the Generation API's protobuf) and hands ``route_request`` plain values: the output
limit (``max_output_tokens`` resolves OpenAI's two names of it), the prompt's prefix (cut here, at
MAX_PREFIX_CHARS, whatever its form), the parameters conditional rules read, and its headers or
call metadata, which use the same keys:

    x-tokenmill-model            gRPC only: the model id (HTTP has the body's "model")
    x-tokenmill-sla-ms           the response time the client needs, in ms
    x-tokenmill-sla-percentile   50 (medians, the default) or 99 (judge on p99s: the worst case)
    x-tokenmill-metadata         a JSON object of strings, numbers and booleans, for conditional routes
    authorization                Bearer TOKEN: passed to the engine, whose tenants it names

A bad value is an InvalidArgumentError naming the header and the limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidArgumentError, UnauthenticatedError
from services.gateway.routing.build import Route
from services.gateway.routing.request import RouteRequest

if TYPE_CHECKING:
    from services.gateway.rate_limits import Grant

SLA_HEADER = "x-tokenmill-sla-ms"
PERCENTILE_HEADER = "x-tokenmill-sla-percentile"
METADATA_HEADER = "x-tokenmill-metadata"
MODEL_HEADER = "x-tokenmill-model"
MAX_METADATA_CHARS = 4096
MAX_PREFIX_CHARS = 4096
"""Routing reads no more of a prompt than this (prefix affinity hashes at most its first blocks)."""


def sla_from(headers: Mapping[str, str], default_ms: float | None, default_worst: bool) -> tuple[float | None, bool]:
    """(sla_ms, worst_case) of a request: its headers, else the route's defaults."""
    sla = default_ms
    raw = headers.get(SLA_HEADER)
    if raw is not None:
        try:
            sla = float(raw)
        except ValueError:
            sla = math.nan
        if not (math.isfinite(sla) and sla > 0):
            raise InvalidArgumentError(f"{SLA_HEADER} must be a number of milliseconds > 0, got {raw!r}")
    worst = default_worst
    raw = headers.get(PERCENTILE_HEADER)
    if raw is not None:
        if raw.strip() not in ("50", "99"):
            raise InvalidArgumentError(f"{PERCENTILE_HEADER} must be 50 or 99, got {raw!r}")
        worst = raw.strip() == "99"
    return sla, worst


def metadata_from(headers: Mapping[str, str], body_metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The request's routing metadata: the body's ``metadata`` overlaid by the header's."""
    merged: dict[str, Any] = dict(body_metadata or {})
    raw = headers.get(METADATA_HEADER)
    if raw is None:
        return merged
    if len(raw) > MAX_METADATA_CHARS:
        raise InvalidArgumentError(f"{METADATA_HEADER} has {len(raw)} characters; the limit is {MAX_METADATA_CHARS}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{METADATA_HEADER} must be a JSON object: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float, bool)) for v in value.values()):
        raise InvalidArgumentError(f"{METADATA_HEADER} must be a JSON object of strings, numbers and booleans")
    merged.update(value)
    return merged


def forwarded_auth(value: str | None) -> tuple[tuple[str, str], ...]:
    """The client's Authorization as engine call metadata (which must be printable ASCII)."""
    if value is None:
        return ()
    if not value.isascii() or not value.isprintable():
        raise UnauthenticatedError("malformed Authorization header: send 'Bearer TOKEN' in printable ASCII")
    return (("authorization", value),)


def route_request(route: Route, headers: Mapping[str, str], *, max_tokens: int | None, prefix: str,
                  params: Mapping[str, Any], body_metadata: Mapping[str, Any] | None = None,
                  budget: Grant | None = None) -> RouteRequest:
    """The routing request of one prompt: its SLA and metadata from ``headers`` (else the route's
    defaults), the output it expects (``max_tokens``, else the route's ``expected_output_tokens``)."""
    sla, worst = sla_from(headers, route.sla_ms, route.worst_case)
    return RouteRequest(route.model, max_tokens or route.expected_output_tokens, sla, worst, prefix, params,
                        metadata_from(headers, body_metadata), budget)


def max_output_tokens(max_completion_tokens: int | None, max_tokens: int | None) -> int | None:
    """OpenAI's two names of one limit: ``max_completion_tokens`` (the newer) wins."""
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


def text_prefix(text: str) -> str:
    return text[:MAX_PREFIX_CHARS]


def chat_prefix(messages: Sequence[tuple[str, str]]) -> str:
    """The leading text of a conversation as prefix affinity hashes it: role and content per turn."""
    parts: list[str] = []
    size = 0
    for role, content in messages:
        parts.append(f"<{role}>{content}\n")
        size += len(parts[-1])
        if size >= MAX_PREFIX_CHARS:
            break
    return "".join(parts)[:MAX_PREFIX_CHARS]


def ids_prefix(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids[:MAX_PREFIX_CHARS // 4]))[:MAX_PREFIX_CHARS]
