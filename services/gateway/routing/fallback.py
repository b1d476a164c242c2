"""``fallback``: the children in order; the next one serves when the one before fails.

The dispatcher moves on for UNAVAILABLE, RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED (see
services/gateway/dispatch.py), and only while nothing has been streamed to the client.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.gateway.routing.node import Node, Ranking, child_ranking, concat, leaves_of
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


class Fallback:
    def __init__(self, children: list[Node]) -> None:
        self.children = children

    def rank(self, request: RouteRequest) -> Ranking:
        rankings = [child_ranking(child, request) for child in self.children]
        first = next((r for r in rankings if r is not None), None)
        if first is None:
            return Ranking([], "no_healthy_target")
        reason = "primary" if first is rankings[0] else "fallback_unhealthy"
        rankings = [r for r in rankings if r is not None]
        return Ranking(concat(r.targets for r in rankings), reason, first.explore, first.estimate_ms)

    def leaves(self) -> Iterator[TargetState]:
        return leaves_of(self.children)
