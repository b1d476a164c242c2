"""The gateway's Prometheus metrics: what it routed where and why, how good its estimates were.

    tokenmill:gateway_requests_total{model,target,outcome}     outcome: ok, or the gRPC code's name
    tokenmill:gateway_decisions_total{model,target,reason}     reason: why the target was chosen
                                                               (sla_cheapest, lowest_estimate, explore,
                                                               weighted, affinity, fallback ...)
    tokenmill:gateway_fallbacks_total{model,target,code}       a target failed before streaming; the
                                                               request moved on
    tokenmill:gateway_estimate_ratio{target}                   observed / estimated response time
    tokenmill:gateway_routing_seconds                          time to rank a request's targets
    tokenmill:gateway_target_healthy{target}                   1 while the target is in the pool
    tokenmill:gateway_http_requests_total{endpoint,status}
    tokenmill:gateway_key_requests_total{tenant,outcome}        per API key, named by its tenant (never
                                                               the key): admitted, or the limit that
                                                               refused it (requests_per_minute,
                                                               tokens_per_minute)
    tokenmill:gateway_key_tokens_total{tenant,kind}            kind: prompt, completion
    tokenmill:gateway_target_rate_limited_total{target,limit}  a target passed over at its limit

Each gateway has its own registry (tests run several in one process); /metrics serves it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "tokenmill:gateway_"
ROUTING_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests_total", "Requests by model, target and outcome",
                                ["model", "target", "outcome"], registry=r)
        self.decisions = Counter(PREFIX + "decisions_total", "Routing decisions by model, target and reason",
                                 ["model", "target", "reason"], registry=r)
        self.fallbacks = Counter(PREFIX + "fallbacks_total", "Requests moved to the next target, by the one that "
                                 "failed and its status code", ["model", "target", "code"], registry=r)
        self.estimate_ratio = Histogram(PREFIX + "estimate_ratio", "Observed over estimated response time of "
                                        "finished requests", ["target"], buckets=RATIO_BUCKETS, registry=r)
        self.routing_seconds = Histogram(PREFIX + "routing_seconds", "Time to rank one request's targets",
                                         buckets=ROUTING_BUCKETS, registry=r)
        self.healthy = Gauge(PREFIX + "target_healthy", "1 while the target is in the pool", ["target"], registry=r)
        # Tenants come from the API keys file, targets from the routes file: bounded label sets.
        self.key_requests = Counter(PREFIX + "key_requests_total", "Requests by API key (named by its tenant) "
                                    "and outcome (admitted, or the limit that refused it)", ["tenant", "outcome"],
                                    registry=r)
        self.key_tokens = Counter(PREFIX + "key_tokens_total", "Prompt and completion tokens by API key (named "
                                  "by its tenant)", ["tenant", "kind"], registry=r)
        self.target_limited = Counter(PREFIX + "target_rate_limited_total", "Requests that passed a target over "
                                      "at its rate limit", ["target", "limit"], registry=r)
        self.http = Counter(PREFIX + "http_requests_total", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
