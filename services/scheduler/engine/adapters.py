"""The LoRA adapters the engine's executors serve, as the scheduler knows them: what a request
may name, and the identity its prefix-cache scope is narrowed by."""

from __future__ import annotations

import json
from collections.abc import Iterable

from services.common.adapters import AdapterInfo
from services.common.errors import NotFoundError


def adapter_scope(cache_scope: str, adapter: AdapterInfo) -> str:
    """``cache_scope`` narrowed to one adapter's weights: K/V computed with adapter X (or the
    base) never serves a request of adapter Y, nor a name loaded again with other files."""
    return json.dumps([cache_scope, "adapter", adapter.name, adapter.fingerprint])


class AdapterTable:
    def __init__(self) -> None:
        self._by_name: dict[str, AdapterInfo] = {}

    def learn(self, adapters: Iterable[AdapterInfo]) -> None:
        """An executor's report (at attach, or its answer to a load)."""
        for adapter in adapters:
            self._by_name[adapter.name] = adapter

    def forget(self, name: str) -> bool:
        return self._by_name.pop(name, None) is not None

    def all(self) -> list[AdapterInfo]:
        return sorted(self._by_name.values(), key=lambda a: a.name)

    def get(self, name: str) -> AdapterInfo | None:
        return self._by_name.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def resolve(self, name: str) -> AdapterInfo:
        adapter = self._by_name.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self._by_name)[:20]) or "none"
            raise NotFoundError(f"adapter {name[:200]!r} is not loaded on this engine (loaded: {loaded})")
        return adapter
