"""Who may call the public API: bearer tokens mapped to tenants, and what each tenant may ask.

``--auth-tokens-file PATH`` names a JSON list of tenants::

    [{"token": "s3cret-a", "tenant": "team-a"},
     {"token": "s3cret-b", "tenant": "team-b", "models": ["stories260K"], "max_priority": 0,
      "tokens_per_minute": 20000, "cache_group": "research"},
     {"token": "s3cret-gw", "tenant": "gateway", "may_set_fairness_key": true},
     {"token": "s3cret-ops", "tenant": "ops", "admin": true}]

Clients send ``authorization: Bearer TOKEN`` metadata on every Generation call. No token or an
unknown one is UNAUTHENTICATED (on the Admin service too, where a tenant without ``"admin": true``
is PERMISSION_DENIED); a tenant asking for what it may not (a model it is not given, a
priority more urgent than ``max_priority``, more than ``tokens_per_minute``) is
PERMISSION_DENIED or RESOURCE_EXHAUSTED. Health and reflection stay open: load balancers and
grpcurl need them, and they reveal nothing a tenant could misuse.

Tokens are compared in constant time (hmac.compare_digest against every known token, so the
time taken does not say which one, or how much of one, matched) and are never logged: only
the tenant name is, bound to every log line of the call. The file must be private to the
server's user (its group may read it) and is re-read on SIGHUP (``reload_auth``):
a file that no longer loads leaves the tenants as they were, with an error in the log.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from services.common.errors import PermissionDeniedError
from services.common.interceptor import StreamBehavior, UnaryBehavior, rebuild_handler, refusing_handler
from services.common.log_limit import RateLimitedLog
from services.scheduler.token_budget import TokenBudget

_log = structlog.get_logger("tokenmill.scheduler.auth")

PROTECTED_SERVICES = ("tokenmill.v1.Generation", "tokenmill.v1.Admin")
"""The services a call needs a token for (Admin also needs an admin tenant: admin_servicer.py)."""
MAX_TOKEN_CHARS = 4096

current_tenant: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("tokenmill_tenant", default=None)
"""The tenant of the call being handled (None when authentication is off)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    models: tuple[str, ...] | None = None
    """Model names this tenant may use; None = every model."""
    max_priority: int | None = None
    """The most urgent priority it may ask for (lower is served first, so a request whose
    priority is below this is refused); None = any."""
    tokens_per_minute: int | None = None
    """Prompt + generated tokens it may use in any 60 s; None = no limit."""
    cache_group: str | None = None
    """Tenants of one group reuse each other's cached prompt prefixes; None = its own prefixes
    only (the default: a shared prefix cache tells one tenant, through cached_tokens and its
    time to first token, which prompts another sent)."""
    may_set_fairness_key: bool = False
    """Trusted to split its share between its own clients (GenerateRequest.fairness_key, the
    gateway's API keys): each key is then scheduled as a tenant of its own. Off by default: a
    tenant naming fresh keys would otherwise outnumber the others."""
    admin: bool = False
    """May call the Admin service (load and unload LoRA adapters for every tenant). Off by
    default: an adapter changes what every tenant naming it is served."""

    @property
    def cache_scope(self) -> str:
        """Whose cached prefixes its requests may reuse (Request.cache_scope)."""
        return f"group:{self.cache_group}" if self.cache_group is not None else f"tenant:{self.name}"

    def check_request(self, model_name: str, priority: int) -> None:
        if self.models is not None and model_name not in self.models:
            raise PermissionDeniedError(f"tenant {self.name!r} may not use model {model_name!r} "
                                        f"(allowed: {', '.join(self.models) or 'none'})")
        if self.max_priority is not None and priority < self.max_priority:
            raise PermissionDeniedError(f"tenant {self.name!r} may not ask for priority {priority}; its most urgent "
                                        f"priority is max_priority={self.max_priority} (lower is served first)")

    def scheduling_tenant(self, fairness_key: str) -> str:
        """Whose share a request draws on: its tenant's, or with ``fairness_key`` from a trusted
        tenant that key's within it. An untrusted tenant's key is ignored (not refused: a gateway
        with API keys sets it on every request, also to an engine that does not trust it)."""
        if not fairness_key or not self.may_set_fairness_key:
            return self.name
        return json.dumps([self.name, fairness_key])


def salted_scope(scope: str, salt: str) -> str:
    """A cache scope (Tenant.cache_scope, or "" without tenants) narrowed by a request's
    ``cache_salt``: requests share cached prefixes only with the same scope and salt."""
    return json.dumps([scope, salt]) if salt else scope


class AuthTable:
    """The tenants of an auth tokens file, looked up by bearer token in constant time."""

    def __init__(self, entries: list[tuple[bytes, Tenant]]) -> None:
        self._entries = entries
        self._budgets = {tenant.name: TokenBudget(tenant.tokens_per_minute)
                         for _, tenant in entries if tenant.tokens_per_minute is not None}

    def keep_budgets_of(self, previous: AuthTable) -> None:
        """A reloaded file: each tenant that keeps a budget keeps what it used in the window
        (and its requests in flight settle against it), at the new limit."""
        for name, budget in self._budgets.items():
            old = previous._budgets.get(name)
            if old is not None:
                old.limit = budget.limit
                self._budgets[name] = old

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> set[str]:
        """The tenant names (several tokens may name one tenant)."""
        return {tenant.name for _, tenant in self._entries}

    def token_for(self, model_name: str, priority: int = 0) -> str | None:
        """A token whose tenant may ask for ``model_name`` at ``priority`` (the first in the file),
        for a client of the operator's own (``tokenmill up``'s demo); None when no tenant may."""
        for token, tenant in self._entries:
            try:
                tenant.check_request(model_name, priority)
            except PermissionDeniedError:
                continue
            return token.decode("utf-8", "surrogatepass")
        return None

    def authenticate(self, token: str) -> Tenant | None:
        presented = token.encode("utf-8", "surrogatepass")
        found = None
        for known, tenant in self._entries:  # every entry, so the time does not depend on which matched
            if hmac.compare_digest(presented, known):
                found = tenant
        return found

    def budget(self, tenant: Tenant) -> TokenBudget | None:
        return self._budgets.get(tenant.name)


def load_auth_tokens(path: str | Path) -> AuthTable:
    """Read and check an auth tokens file; ValueError names the entry and the field."""
    origin = str(path)
    try:
        mode = Path(path).stat().st_mode
        if mode & 0o027:
            # A token file others may read hands out every tenant; one others may write, tenants.
            # Group read stays allowed: a Kubernetes Secret is mounted root-owned, readable by
            # the pod's fsGroup.
            raise ValueError(f"auth_tokens_file {origin}: open to others or writable by its group (mode "
                             f"{stat.S_IMODE(mode):04o}); make it private (chmod 600, or 640)")
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"auth_tokens_file {origin}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"auth_tokens_file {origin}: not JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"auth_tokens_file {origin}: expected a non-empty JSON list of "
                         '{"token", "tenant"} objects')
    entries: list[tuple[bytes, Tenant]] = []
    seen: set[str] = set()
    for index, item in enumerate(data):
        where = f"auth_tokens_file {origin}: entry {index}"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        unknown = set(item) - {"token", "tenant", "models", "max_priority", "tokens_per_minute", "cache_group",
                               "may_set_fairness_key", "admin"}
        if unknown:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)}")
        token, name = item.get("token"), item.get("tenant")
        if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS or token != token.strip():
            raise ValueError(f"{where}: token must be a non-empty string without surrounding spaces, "
                             f"at most {MAX_TOKEN_CHARS} characters")
        if token in seen:
            raise ValueError(f"{where}: its token is already given to another entry")
        seen.add(token)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: tenant must be a non-empty string")
        models = item.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ValueError(f"{where}: models must be a list of model names")
        max_priority = (_optional_int(item, "max_priority", where, minimum=None) if "max_priority" in item
                        else DEFAULT_MAX_PRIORITY)
        tokens_per_minute = _optional_int(item, "tokens_per_minute", where, minimum=1)
        cache_group = item.get("cache_group")
        if cache_group is not None and (not isinstance(cache_group, str) or not cache_group):
            raise ValueError(f"{where}: cache_group must be a non-empty string")
        trusted = item.get("may_set_fairness_key", False)
        if not isinstance(trusted, bool):
            raise ValueError(f"{where}: may_set_fairness_key must be true or false, got {trusted!r}")
        admin = item.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: admin must be true or false, got {admin!r}")
        entries.append((token.encode(), Tenant(name, None if models is None else tuple(models), max_priority,
                                              tokens_per_minute, cache_group, trusted, admin)))
    return AuthTable(entries)


DEFAULT_MAX_PRIORITY = 0
"""A tenant's most urgent priority when its entry names none: the default priority, so no tenant
(nor a client behind a gateway, which passes the body's priority on) jumps ahead of the others
unless the file says it may; ``"max_priority": null`` lets it ask for any."""


def _optional_int(item: dict[str, Any], name: str, where: str, minimum: int | None) -> int | None:
    value = item.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{where}: {name} must be an integer{bound}, got {value!r}")
    return value


def bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call to the public API from its metadata alone, before its body is
    decoded; other services on the server pass.

    It is a front interceptor (outside the error mapping): an unauthenticated call is answered
    UNAUTHENTICATED by a handler that has no deserializer, so a caller without a token cannot
    make the server parse 16 MiB bodies, and its refusals are logged at a bounded rate
    (services/common/log_limit.py), not one line each. An authenticated call's handler runs with
    ``current_tenant`` set and the tenant bound to its log lines. ``table`` may be replaced at any
    time (a reload): each call reads it once.
    """

    def __init__(self, table: AuthTable) -> None:
        self.table = table
        self.refused = 0
        self._log = RateLimitedLog(_log)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(tuple(f"/{name}/" for name in PROTECTED_SERVICES)):
            return handler
        token = bearer_token(details.invocation_metadata)
        tenant = self.table.authenticate(token) if token else None
        if tenant is None:
            reason = MISSING_CREDENTIALS if token is None else UNKNOWN_TOKEN
            self.refused += 1
            self._log.log("info", "unauthenticated_call", details.method, method=details.method, reason=reason)
            return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, reason)
        return rebuild_handler(handler, lambda behavior: _unary_as(tenant, behavior),
                               lambda behavior: _stream_as(tenant, behavior))


MISSING_CREDENTIALS = "missing credentials: send 'authorization: Bearer TOKEN' metadata"
UNKNOWN_TOKEN = "unknown or malformed bearer token"


def _unary_as(tenant: Tenant, behavior: UnaryBehavior) -> UnaryBehavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        current_tenant.set(tenant)
        with structlog.contextvars.bound_contextvars(tenant=tenant.name):
            return await behavior(request, context)

    return handler


def _stream_as(tenant: Tenant, behavior: StreamBehavior) -> StreamBehavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext):
        current_tenant.set(tenant)
        with structlog.contextvars.bound_contextvars(tenant=tenant.name):
            async for response in behavior(request, context):
                yield response

    return handler


def reload_auth(path: str, interceptor: AuthInterceptor, owners: list[Any]) -> AuthTable | None:
    """SIGHUP: re-read the tokens file into ``interceptor`` and the ``owners`` that hold the
    table (their ``auth_table``); budgets carry over by tenant. None, the old table kept and the
    error logged, when the file does not load."""
    try:
        table = load_auth_tokens(path)
    except ValueError as exc:
        _log.error("auth_tokens_reload_failed", error=str(exc))
        return None
    table.keep_budgets_of(interceptor.table)
    interceptor.table = table
    for owner in owners:
        owner.auth_table = table
    _log.info("auth_tokens_reloaded", tenants=len(table.tenants))
    return table
