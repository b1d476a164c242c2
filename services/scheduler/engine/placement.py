"""Where a request runs: the executor holding the longest cached prefix of it, else the least loaded.

Each executor keeps its own KV pool, so a prompt whose prefix one executor has cached costs
less there; among equals (no hit anywhere, the usual case) the executor with the fewest
requests running and waiting takes it, then the one with the most free blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.scheduler.request.request import Request

if TYPE_CHECKING:
    from services.scheduler.engine.lane import ExecutorLane

ROLES_FOR_NEW = ("prefill", "mixed")
"""Executors that take new requests (their prompts)."""
ROLES_FOR_DECODE = ("decode", "mixed")
"""Executors a request may continue on once its prompt is computed."""
ANY_ROLE = ("prefill", "decode", "mixed")
"""The fallback when no executor of the preferred roles is attached: every executor can run a
whole request (a decode executor computes the prompt itself, as when a KV copy fails)."""


def choose_lane(request: Request, lanes: Sequence[ExecutorLane], roles: Sequence[str]) -> ExecutorLane | None:
    """The lane (of one of ``roles``) to run ``request`` on, or None when no such lane is attached."""
    best, best_key = None, None
    for lane in lanes:
        if lane.role not in roles:
            continue
        scheduler = lane.scheduler
        manager = scheduler.block_manager
        cached = manager.prefixes.index.cached_prefix_tokens(request.all_token_ids, request.cache_scope)
        key = (-cached, len(scheduler.running) + len(scheduler.waiting), -manager.pool.num_free)
        if best_key is None or key < best_key:
            best, best_key = lane, key
    return best
