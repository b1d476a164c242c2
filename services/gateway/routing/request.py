"""What routing sees of one request: plain values, whichever front end (HTTP or gRPC) it came by."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.gateway.rate_limits import Grant


@dataclass(slots=True)
class RouteRequest:
    model: str
    """The model id the client asked for (a key of the routes file's ``models``)."""
    expected_output_tokens: int
    """max_tokens when the client set it, else the model's ``expected_output_tokens``."""
    sla_ms: float | None = None
    """The response time the client needs (``x-tokenmill-sla-ms``), else the model's default; None = no SLA."""
    worst_case: bool = False
    """Judge the SLA on p99 latencies instead of medians (``x-tokenmill-sla-percentile: 99``)."""
    prefix: str = ""
    """The prompt's leading text (chat turns joined), for prefix affinity."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Request parameters (the OpenAI body's fields), for conditional rules: ``params.max_tokens``."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Client metadata (``x-tokenmill-metadata`` or the body's ``metadata``): ``metadata.tier``."""
    budget: Grant | None = None
    """The API key's grant the request draws on (api_keys.py); the dispatcher counts each engine
    call's tokens on it, the front end settles it when the request ends. None: keyless."""

    def lookup(self, path: str) -> tuple[bool, Any]:
        """(found, value) of a dotted path such as ``params.max_tokens`` or ``metadata.tier``."""
        head, _, rest = path.partition(".")
        if head == "params":
            value: Any = self.params
        elif head == "metadata":
            value = self.metadata
        elif head in ("model", "sla_ms", "expected_output_tokens", "worst_case") and not rest:
            return True, getattr(self, head)
        else:
            return False, None
        for part in rest.split(".") if rest else ():
            if not isinstance(value, Mapping) or part not in value:
                return False, None
            value = value[part]
        return True, value
