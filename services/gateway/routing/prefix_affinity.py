"""``prefix-affinity``: requests sharing their leading text go to the same target, within a load bound.

The prompt's first ``prefix_chars`` characters, cut to whole blocks of ``block_chars`` (so
prompts that share a system prompt but differ after it share the key), are hashed; targets are
ordered by rendezvous hashing on that key (highest random weight: each target scores
hash(key, target) and the highest wins, so adding or losing a target moves only the keys it
wins or held). The first target in that order whose in-flight count is below
``load_factor`` x the mean (+1) is taken, as consistent hashing with bounded loads does: a
shared system prompt keeps hitting one replica's prefix cache until that replica is clearly
busier than the rest. A prompt shorter than one block has no affinity: least loaded first.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

from services.gateway.routing.node import Ranking
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


def prefix_key(text: str, prefix_chars: int, block_chars: int) -> int | None:
    """The hash of the whole blocks among the first ``prefix_chars`` characters; None if under one block."""
    usable = min(len(text), prefix_chars) // block_chars * block_chars
    if usable == 0:
        return None
    digest = hashlib.blake2b(text[:usable].encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _target_seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class PrefixAffinity:
    def __init__(self, targets: list[TargetState], *, prefix_chars: int = 256, block_chars: int = 64,
                 load_factor: float = 1.25) -> None:
        self.targets = targets
        self.prefix_chars = prefix_chars
        self.block_chars = block_chars
        self.load_factor = load_factor
        # hash() of a tuple of ints is not salted per process: the same key maps the same way in
        # every gateway replica.
        self._seeds = [_target_seed(t.name) for t in targets]

    def rank(self, request: RouteRequest) -> Ranking:
        healthy = [(seed, t) for seed, t in zip(self._seeds, self.targets) if t.healthy]
        if not healthy:
            return Ranking([], "no_healthy_target")
        key = prefix_key(request.prefix, self.prefix_chars, self.block_chars)
        if key is None:
            return Ranking(sorted((t for _, t in healthy), key=lambda t: t.inflight), "least_loaded")
        healthy.sort(key=lambda entry: hash((key, entry[0])), reverse=True)
        order = [t for _, t in healthy]
        bound = math.ceil(self.load_factor * (sum(t.inflight for t in order) + 1) / len(order))
        for index, target in enumerate(order):
            if target.inflight < bound:
                if index == 0:
                    return Ranking(order, "affinity")
                return Ranking([target, *order[:index], *order[index + 1:]], "affinity_overflow")
        return Ranking(order, "affinity")

    def leaves(self) -> Iterator[TargetState]:
        return iter(self.targets)
