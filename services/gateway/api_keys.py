"""The gateway's own API keys: each names a tenant, so tenants stay apart without engine auth.

``--api-keys-file PATH`` names a JSON list, as the engine's tokens file does::

    [{"key": "sk-team-a-...", "tenant": "team-a"},
     {"key": "sk-team-b-...", "tenant": "team-b", "models": ["chat"], "max_concurrent_requests": 8,
      "cache_group": "research", "max_priority": -10,
      "requests_per_minute": 600, "tokens_per_minute": 200000, "adapters": ["support-v2"]},
     {"key": "sk-ops-...", "tenant": "ops", "admin": true}]

With it, every ``/v1/`` HTTP request and every Generation call needs ``Authorization: Bearer
KEY``: no key or an unknown one is 401 (UNAUTHENTICATED), a model the key is not given 403
(PERMISSION_DENIED), a LoRA adapter (a model id naming one) outside the key's ``adapters`` 404
as a model that does not exist (a key learns nothing of other tenants' adapters; ``/v1/models``
lists only its own), the admin endpoints without ``"admin": true`` 403, more requests of its tenant in flight than ``max_concurrent_requests``
429 (RESOURCE_EXHAUSTED), a body ``priority`` more urgent (lower) than the key's
``max_priority`` (default 0, the default priority; ``null`` = any) 400 (INVALID_ARGUMENT) naming
``priority`` and the bound, more requests or tokens a minute than its ``requests_per_minute`` or
``tokens_per_minute`` 429 (RESOURCE_EXHAUSTED) with ``retry-after`` (rate_limits.py: prompt +
completion tokens, ``max_tokens`` reserved at admission and settled to the usage when the request
ends, on every endpoint and the gRPC intake). Each key's requests and tokens are counted on
``/metrics`` under its tenant's name (never the key). The key's tenant (or its ``cache_group``) becomes the engine request's
``cache_salt``: requests reuse cached prefixes only within it, so ``cached_tokens`` tells a key
nothing about another's prompts. The tenant is also the request's ``fairness_key``: the engine
shares its time fairly between keys' tenants as between its own (an engine with tenants honours
it only from a tenant with ``"may_set_fairness_key": true``, the gateway's). The key itself is never sent on to an engine. Without the file
the gateway is keyless (loopback development) and forwards the client's Authorization to the
engines, whose own tenants then apply.

Keys are compared in constant time (hmac.compare_digest against every known key) and never
logged; the file must be private to the gateway's user (its group may read it: a Kubernetes
Secret is mounted root-owned, readable by the pod's fsGroup).
"""

from __future__ import annotations

import hmac
import json
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgumentError, PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError
from services.gateway.metrics import GatewayMetrics
from services.gateway.rate_limits import FIELDS as LIMIT_FIELDS, Grant, RateLimited, RateLimiter, RateLimits, parse_limits

MAX_KEY_CHARS = 4096
FIELDS = {"key", "tenant", "models", "adapters", "admin", "max_concurrent_requests", "cache_group", "max_priority",
          *LIMIT_FIELDS}
DEFAULT_MAX_PRIORITY = 0
"""A key's most urgent priority when its entry names none: the default priority, so no client
jumps ahead of the others by naming ``"priority": -2147483648`` in its body."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    tenant: str
    models: tuple[str, ...] | None = None
    """Model ids this key may use; None = every model."""
    max_concurrent_requests: int | None = None
    """Requests (HTTP requests, Generation calls) its tenant may have in flight at once; None = no
    limit."""
    cache_group: str | None = None
    """Keys of one group share cached prefixes; by default a key's tenant shares only its own."""

    max_priority: int | None = DEFAULT_MAX_PRIORITY
    """The most urgent priority its requests may ask for (lower is served first); a request
    below it is refused with INVALID_ARGUMENT (400) naming ``priority``; None = any."""

    limits: RateLimits = RateLimits()
    """Its requests and tokens per minute (rate_limits.py); none by default."""

    adapters: tuple[str, ...] | None = None
    """LoRA adapters (model ids naming one) this key may use; None = every adapter of the models
    it may use. One it may not use is answered as a model that does not exist."""
    admin: bool = False
    """May load and unload adapters through the gateway's admin endpoints."""

    def may_use_adapter(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters

    @property
    def cache_salt(self) -> str:
        return f"group:{self.cache_group}" if self.cache_group is not None else f"tenant:{self.tenant}"

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise PermissionDeniedError(f"this API key may not use the model '{model}'")

    def check_priority(self, priority: int) -> None:
        # Refused, not clamped: a clamped request would run at a priority its client did not ask
        # for without being told; the 400 names the bound so the client can send a valid one.
        if self.max_priority is not None and priority < self.max_priority:
            raise InvalidArgumentError(f"priority {priority} is more urgent than this API key's max_priority "
                                       f"{self.max_priority} (lower is served first): send priority >= "
                                       f"{self.max_priority}")


class ApiKeys:
    def __init__(self, entries: list[tuple[bytes, ApiKey]], metrics: GatewayMetrics | None = None) -> None:
        self._entries = entries
        self._in_flight: dict[str, int] = {}
        self.metrics = metrics
        """Where each key's requests and tokens are counted, by tenant (main.py sets it)."""
        # By the entry's identity: two entries may be equal in all but their secret.
        self._limiters = {id(key): RateLimiter(key.limits, "this API key") for _, key in entries if key.limits}

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key of an ``Authorization: Bearer KEY`` value; UnauthenticatedError otherwise."""
        if not authorization:
            raise UnauthenticatedError("no API key: send 'Authorization: Bearer KEY'")
        scheme, _, presented = authorization.partition(" ")
        found = None
        candidate = presented.strip().encode("utf-8", "surrogatepass")
        for known, key in self._entries:  # every entry, so the time does not say which matched
            if hmac.compare_digest(candidate, known):
                found = key
        if scheme.lower() != "bearer" or found is None:
            raise UnauthenticatedError("incorrect API key provided")
        return found

    @contextmanager
    def in_flight(self, key: ApiKey) -> Iterator[None]:
        """Count one request of ``key`` while it runs; over its limit, ResourceExhaustedError."""
        name = key.tenant
        held = self._in_flight.get(name, 0)
        if key.max_concurrent_requests is not None and held >= key.max_concurrent_requests:
            raise ResourceExhaustedError(f"this API key has {held} requests in flight; its limit "
                                         f"max_concurrent_requests is {key.max_concurrent_requests}",
                                         retry_after_s=1.0)
        self._in_flight[name] = held + 1
        try:
            yield
        finally:
            self._in_flight[name] -= 1
            if not self._in_flight[name]:
                del self._in_flight[name]


    def admit(self, key: ApiKey, tokens: int) -> Grant:
        """One request of ``key`` reserving ``tokens`` (prompt + completion) within its limits;
        ResourceExhaustedError (with the wait) over them. The request settles the grant when it ends."""
        limiter = self._limiters.get(id(key))
        try:
            grant = Grant(None, tokens) if limiter is None else limiter.admit(tokens)
        except RateLimited as exc:
            if self.metrics is not None:
                self.metrics.key_requests.labels(key.tenant, exc.limit).inc()
            raise
        if self.metrics is not None:
            self.metrics.key_requests.labels(key.tenant, "admitted").inc()
            tokens_counter = self.metrics.key_tokens
            prompt, completion = tokens_counter.labels(key.tenant, "prompt"), tokens_counter.labels(key.tenant, "completion")

            def count(prompt_tokens: int, completion_tokens: int) -> None:
                prompt.inc(prompt_tokens)
                completion.inc(completion_tokens)

            grant.on_use = count
        return grant


def load_api_keys(path: str | Path, metrics: GatewayMetrics | None = None) -> ApiKeys:
    """Read and check an API keys file; ValueError names the entry and the field."""
    origin = str(path)
    try:
        mode = Path(path).stat().st_mode
        if mode & 0o027:
            raise ValueError(f"api_keys_file {origin}: open to others or writable by its group (mode "
                             f"{stat.S_IMODE(mode):04o}); make it private (chmod 600, or 640)")
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"api_keys_file {origin}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"api_keys_file {origin}: not JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f'api_keys_file {origin}: expected a non-empty JSON list of {{"key", "tenant"}} objects')
    entries: list[tuple[bytes, ApiKey]] = []
    seen: set[str] = set()
    for index, item in enumerate(data):
        where = f"api_keys_file {origin}: entry {index}"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        if unknown := set(item) - FIELDS:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)}")
        key, tenant = item.get("key"), item.get("tenant")
        if (not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS or key != key.strip()
                or not key.isascii() or not key.isprintable() or " " in key):
            raise ValueError(f"{where}: key must be a non-empty string of printable ASCII without spaces, at most "
                             f"{MAX_KEY_CHARS} characters")
        if key in seen:
            raise ValueError(f"{where}: its key is already given to another entry")
        seen.add(key)
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{where}: tenant must be a non-empty string")
        models = item.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ValueError(f"{where}: models must be a list of model ids")
        limit = _optional_positive_int(item, "max_concurrent_requests", where)
        group = item.get("cache_group")
        if group is not None and (not isinstance(group, str) or not group):
            raise ValueError(f"{where}: cache_group must be a non-empty string")
        max_priority = item.get("max_priority", DEFAULT_MAX_PRIORITY)
        if max_priority is not None and (not isinstance(max_priority, int) or isinstance(max_priority, bool)
                                         or not -(2**31) <= max_priority < 2**31):
            raise ValueError(f"{where}: max_priority must be a 32-bit integer or null, got {max_priority!r}")
        adapters = item.get("adapters")
        if adapters is not None and (not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)):
            raise ValueError(f"{where}: adapters must be a list of adapter names")
        admin = item.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: admin must be true or false, got {admin!r}")
        entries.append((key.encode(), ApiKey(tenant, None if models is None else tuple(models), limit, group,
                                             max_priority, parse_limits(item, where),
                                             None if adapters is None else tuple(adapters), admin)))
    return ApiKeys(entries, metrics)


def _optional_positive_int(item: dict[str, Any], name: str, where: str) -> int | None:
    value = item.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value
