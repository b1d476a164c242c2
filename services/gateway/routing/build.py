"""The interpreter of the routes file: route nodes as written -> a tree of strategy objects.

    "fast"                                               a target
    {target: fast, weight: 3}                            a target with a weight (inside loadbalance)
    {strategy: loadbalance, targets: [a, {target: b, weight: 3}]}
    {strategy: fallback, targets: [primary, {strategy: loadbalance, targets: [c, d]}]}
    {strategy: conditional, conditions: [{query: {"metadata.tier": {"$eq": "gold"}}, then: big}],
     default: small}
    {strategy: latency, targets: [fast, weak], explore_rate: 0.05, max_exploring: 1, confidence: 0.9,
     cheapest_within: 2.0}
    {strategy: prefix-affinity, targets: [r1, r2, r3], prefix_chars: 256, block_chars: 64,
     load_factor: 1.25}

``latency`` and ``prefix-affinity`` rank targets by their own live state, so their ``targets``
are target names; the other strategies take any node. Portkey's spelling
``strategy: {mode: loadbalance}`` is accepted too. Every error names the path of the node.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.routes_file import ModelSpec
from services.gateway.routing.conditional import Conditional
from services.gateway.routing.fallback import Fallback
from services.gateway.routing.latency import LatencyRouted
from services.gateway.routing.loadbalance import LoadBalance
from services.gateway.routing.node import Node, TargetNode
from services.gateway.routing.prefix_affinity import PrefixAffinity
from services.gateway.routing.query import compile_query
from services.gateway.routing.target import TargetState

STRATEGIES = ("latency", "loadbalance", "fallback", "conditional", "prefix-affinity")
RETRY_ALWAYS = frozenset({"UNAVAILABLE"})
"""A target that is down (or died under the request) before anything was streamed: any route
moves on to its next target."""
RETRY_FALLBACK = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
"""What a route with a ``fallback`` node moves on for."""


@dataclass(slots=True)
class Route:
    """One model id: its tree, its defaults, and which failures move a request to the next target."""

    model: str
    node: Node
    sla_ms: float | None
    worst_case: bool
    expected_output_tokens: int
    retry_codes: frozenset[str]
    tokenizer: str
    tool_call_parser: str = ""
    """The routes file's setting for this model ("" = the gateway's)."""
    reasoning_parser: str = ""
    """The routes file's setting for this model ("" = the gateway's)."""
    adapter: str = ""
    """The LoRA adapter a request of this model id runs with ("" = the base model): a model id
    naming an adapter is its parent's route with this set (Dispatcher.route)."""


class _Builder:
    def __init__(self, targets: dict[str, TargetState], rng: random.Random,
                 clock: Callable[[], float]) -> None:
        self.targets = targets
        self.rng = rng
        self.clock = clock
        self.has_fallback = False

    def target(self, name: Any, where: str) -> TargetState:
        if not isinstance(name, str) or name not in self.targets:
            raise ValueError(f"{where}: unknown target {name!r} (targets: {sorted(self.targets)})")
        return self.targets[name]

    def node(self, spec: Any, where: str) -> Node:
        if isinstance(spec, str):
            return TargetNode(self.target(spec, where))
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: a route node is a target name or an object, got {spec!r}")
        if "target" in spec:
            _only(spec, {"target", "weight"}, where)
            return TargetNode(self.target(spec["target"], where))
        kind = spec.get("strategy")
        if isinstance(kind, dict):
            kind = kind.get("mode")
        if kind not in STRATEGIES:
            raise ValueError(f"{where}: strategy must be one of {list(STRATEGIES)}, got {kind!r}")
        return getattr(self, kind.replace("-", "_"))(spec, where)

    def _children(self, spec: dict, where: str) -> list[Any]:
        children = spec.get("targets")
        if not isinstance(children, list) or not children:
            raise ValueError(f"{where}.targets must be a non-empty list")
        return children

    def loadbalance(self, spec: dict, where: str) -> Node:
        _only(spec, {"strategy", "targets", "weight"}, where)
        raw = self._children(spec, where)
        children = [self.node(c, f"{where}.targets[{i}]") for i, c in enumerate(raw)]
        weights = [_weight(c, f"{where}.targets[{i}]") for i, c in enumerate(raw)]
        if not any(w > 0 for w in weights):
            raise ValueError(f"{where}: at least one weight must be > 0")
        return LoadBalance(children, weights, self.rng)

    def fallback(self, spec: dict, where: str) -> Node:
        _only(spec, {"strategy", "targets", "weight"}, where)
        self.has_fallback = True
        raw = self._children(spec, where)
        return Fallback([self.node(c, f"{where}.targets[{i}]") for i, c in enumerate(raw)])

    def conditional(self, spec: dict, where: str) -> Node:
        _only(spec, {"strategy", "conditions", "default", "weight"}, where)
        raw = spec.get("conditions")
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{where}.conditions must be a non-empty list of {{query, then}}")
        conditions = []
        for i, item in enumerate(raw):
            at = f"{where}.conditions[{i}]"
            if not isinstance(item, dict) or set(item) != {"query", "then"}:
                raise ValueError(f"{at} must be an object with exactly query and then")
            conditions.append((compile_query(item["query"], f"{at}.query"), self.node(item["then"], f"{at}.then")))
        default = spec.get("default")
        return Conditional(conditions, None if default is None else self.node(default, f"{where}.default"))

    def _leaves(self, spec: dict, where: str) -> list[TargetState]:
        leaves = []
        for i, child in enumerate(self._children(spec, where)):
            name = child.get("target") if isinstance(child, dict) else child
            leaves.append(self.target(name, f"{where}.targets[{i}] ({spec['strategy']} takes target names)"))
        return leaves

    def latency(self, spec: dict, where: str) -> Node:
        _only(spec, {"strategy", "targets", "explore_rate", "max_exploring", "confidence", "cheapest_within",
                     "weight"}, where)
        rate = _number(spec, "explore_rate", 0.05, where, 0.0, 1.0)
        exploring = int(_number(spec, "max_exploring", 1, where, 0, 1 << 20))
        confidence = _number(spec, "confidence", 0.9, where, 0.5, 0.99)
        within = _number(spec, "cheapest_within", 2.0, where, 1.0, 1000.0)
        return LatencyRouted(self._leaves(spec, where), explore_rate=rate, max_exploring=exploring,
                             confidence=confidence, cheapest_within=within, rng=self.rng, clock=self.clock)

    def prefix_affinity(self, spec: dict, where: str) -> Node:
        _only(spec, {"strategy", "targets", "prefix_chars", "block_chars", "load_factor", "weight"}, where)
        block = int(_number(spec, "block_chars", 64, where, 1, 1 << 20))
        return PrefixAffinity(self._leaves(spec, where),
                              prefix_chars=int(_number(spec, "prefix_chars", 256, where, block, 1 << 24)),
                              block_chars=block, load_factor=_number(spec, "load_factor", 1.25, where, 1.0, 100.0))


def _only(spec: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown} (allowed here: {sorted(allowed)})")


def _number(spec: dict, name: str, default: float, where: str, low: float, high: float) -> float:
    value = spec.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{where}.{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _weight(spec: Any, where: str) -> float:
    if not isinstance(spec, dict):
        return 1.0
    return _number(spec, "weight", 1.0, where, 0.0, 1e9)


def build_route(model: ModelSpec, targets: dict[str, TargetState], *, rng: random.Random | None = None,
                clock: Callable[[], float] = time.monotonic, where: str = "") -> Route:
    """The route of one model id over the pool's target states."""
    builder = _Builder(targets, rng or random.Random(), clock)
    node = builder.node(model.route, where or f"models.{model.name}.route")
    return Route(model.name, node, model.sla_ms, model.sla_percentile == 99, model.expected_output_tokens,
                 RETRY_FALLBACK if builder.has_fallback else RETRY_ALWAYS, model.tokenizer, model.tool_call_parser,
                 model.reasoning_parser)
