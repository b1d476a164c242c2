"""The deployment's internal secret: what tokenmill's own services present to each other.

An internal service (tokenizer, executor, drafter) trusts its caller: an executor's Step session
decides which KV blocks a sequence attends over, its ReadKVBlocks returns pool contents, and the
drafter holds every running prompt. A loopback port is no trust boundary (any local process, any
container sharing the pod's network reaches it), so without client certificates (mTLS with
``--tls-allowed-clients``) these services take a shared secret: ``--internal-secret-file`` names a
file holding it (one line of at least MIN_CHARS printable characters, private to its owner, as
``tokenmill up`` writes it and Kubernetes mounts it from a Secret), never the command line, where
``ps`` shows it. Every call but the health service's must carry it in the METADATA_KEY header,
else UNAUTHENTICATED before the request is decoded; the scheduler, and an executor reaching a peer,
send it on every call (``call_metadata``).

The secret is read once at start: a new one takes a restart of every service that holds it.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import grpc.aio
import structlog

from services.common.interceptor import refusing_handler
from services.common.log_limit import RateLimitedLog

_log = structlog.get_logger("tokenmill.service")
_refusals = RateLimitedLog(_log)

METADATA_KEY = "x-tokenmill-internal-secret"
MIN_CHARS = 32
FLAG = "--internal-secret-file"
UNCHECKED_PREFIXES = ("/grpc.health.v1.Health/",)
"""Health answers without the secret: probes and load balancers hold none, and it says nothing
of any tenant."""

CallMetadata = tuple[tuple[str, str], ...]


def load_secret(path: str, flag: str = FLAG) -> str:
    """The secret in ``path``; ValueError naming ``flag`` when the file is missing, open to other
    users or writable by its group, or holds less than MIN_CHARS printable characters."""
    try:
        mode = Path(path).stat().st_mode
        text = Path(path).read_text(encoding="ascii")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not ASCII text") from None
    if mode & 0o027:
        raise ValueError(f"{flag} {path}: open to others or writable by its group (mode {stat.S_IMODE(mode):04o}); "
                         "make it private (chmod 600, or 640)")
    secret = text.strip()
    if len(secret) < MIN_CHARS or not secret.isprintable() or any(c.isspace() for c in secret):
        raise ValueError(f"{flag} {path}: the secret must be one word of at least {MIN_CHARS} printable characters")
    return secret


def write_secret_file(path: Path) -> Path:
    """A new random secret in ``path`` (created with mode 0600, never overwritten); returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w", encoding="ascii") as handle:
        handle.write(secrets.token_hex(32) + "\n")
    return path


def call_metadata(secret: str) -> CallMetadata | None:
    """The metadata a call to an internal service carries (None without a secret)."""
    return ((METADATA_KEY, secret),) if secret else None


def presented(metadata) -> bytes:
    """The secret a call presents ('' when none), from its invocation metadata."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value.encode() if isinstance(value, str) else value
    return b""


class InternalSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses UNAUTHENTICATED, before the request is decoded, every call but health's that does
    not carry the secret (compared in constant time)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()
        self.refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(UNCHECKED_PREFIXES):
            return handler
        if hmac.compare_digest(presented(details.invocation_metadata), self._secret):
            return handler
        self.refused += 1
        _refusals.log("warning", "internal_secret_missing", details.method, method=details.method)
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                f"this is an internal service: calls must carry the deployment's secret "
                                f"({METADATA_KEY}; {FLAG})")
