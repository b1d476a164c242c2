"""``conditional``: the first rule that matches the request picks the child; else the default.

No fall-through across branches: a request that matched a rule is served by that branch only
(a rule is policy, e.g. "gold tenants get the large model"), with the branch's own fallbacks.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.gateway.routing.node import Node, Ranking, leaves_of
from services.gateway.routing.query import Predicate
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


class Conditional:
    def __init__(self, conditions: list[tuple[Predicate, Node]], default: Node | None) -> None:
        self.conditions = conditions
        self.default = default

    def rank(self, request: RouteRequest) -> Ranking:
        for index, (matches, child) in enumerate(self.conditions):
            if matches(request):
                ranking = child.rank(request)
                return Ranking(ranking.targets, f"condition_{index}", ranking.explore, ranking.estimate_ms)
        if self.default is None:
            return Ranking([], "no_condition_matched")
        ranking = self.default.rank(request)
        return Ranking(ranking.targets, "default", ranking.explore, ranking.estimate_ms)

    def leaves(self) -> Iterator[TargetState]:
        children = [child for _, child in self.conditions] + ([self.default] if self.default is not None else [])
        return leaves_of(children)
