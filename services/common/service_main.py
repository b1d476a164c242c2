"""What every service's ``main`` module does around its own servicer: one definition, four users.

A service module says what it serves and how to build it; this module starts it the same way
for all four (flags and environment parsed into the service's config dataclass, logging
configured, the server started with the metrics interceptor when metrics are on, the
/metrics endpoint, SERVING, the port file, signals and graceful stop)::

    async def serve(config: TokenizerConfig) -> RunningServer:
        servicer = TokenizerServicer(TextService(config.model))
        running = await start_service(config, "tokenizer", registrar(
            servicer, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer_pb2, "Tokenizer"))
        await announce_serving(running, config)
        return running

    def main(argv=None) -> int:
        return service_main("tokenizer", TokenizerConfig, serve, argv)
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio
import structlog

from services.common.bind_policy import check_bind
from services.common.gc_thresholds import check_gc_young_threshold, set_gc_thresholds
from services.common.internal_secret import InternalSecretInterceptor, load_secret
from services.common.logging import configure_logging
from services.common.metrics import rpc_interceptors, serve_metrics
from services.common.parent_watch import end_with_parent
from services.common.peer_identity import PeerIdentityInterceptor
from services.common.server import RunningServer, run_service, server_options, start_server
from services.common.service_config import publish_port
from services.common.settings import parse_config
from services.common.tls import ClientTLS, ServerTLS


_log = structlog.get_logger("tokenmill.service")


class ServiceProcessConfig(Protocol):
    """The fields service_config.service_process_fields gives every service's config."""

    host: str
    port: int
    port_file: str
    log_level: str
    shutdown_grace_seconds: float
    metrics_port: int
    metrics_host: str
    max_message_bytes: int
    reflection: bool
    tls_cert: str
    tls_key: str
    tls_client_ca: str
    tls_allowed_clients: tuple[str, ...]
    health_port: int
    gc_young_threshold: int
    allow_insecure_bind: bool
    max_concurrent_rpcs: int


ConfigT = TypeVar("ConfigT", bound=ServiceProcessConfig)


MIN_MESSAGE_BYTES = 4096


def check_process_fields(config: ServiceProcessConfig) -> None:
    """The fields every service has, checked before anything is bound: the message limit, and the
    TLS files (readable, PEM, each key its certificate's), errors naming the flag."""
    if config.max_message_bytes < MIN_MESSAGE_BYTES:
        raise ValueError(f"max_message_bytes must be >= {MIN_MESSAGE_BYTES}, got {config.max_message_bytes}")
    check_gc_young_threshold(config.gc_young_threshold)
    if config.tls_allowed_clients and not config.tls_client_ca:
        raise ValueError("tls_allowed_clients names client certificates: it needs --tls-client-ca (mTLS)")
    if config.max_concurrent_rpcs < 0:
        raise ValueError(f"max_concurrent_rpcs must be >= 0 (0 = no bound), got {config.max_concurrent_rpcs}")
    if (server_tls := ServerTLS.from_config(config)) is not None:
        server_tls.load()
    if (backend_tls := ClientTLS.for_backends(config)) is not None:
        backend_tls.check(("--backend-tls-ca", "--backend-tls-cert", "--backend-tls-key"))
    internal_secret(config)


def check_authenticated(config: ServiceProcessConfig) -> None:
    """An internal service must know who calls it (the deployment's secret, or mTLS), and the
    scheduler must present a credential to those it calls, unless --allow-unauthenticated is typed:
    loopback is no trust boundary (any local process may connect), so an unauthenticated start
    is refused rather than warned about. ValueError naming both ways out."""
    if not hasattr(config, "internal_secret_file"):
        return
    secret = internal_secret(config)
    if secret or config.allow_unauthenticated:
        return
    if getattr(config, "internal_secret_required", False):
        if config.tls_client_ca:
            return
        raise ValueError("no caller authentication: set --internal-secret-file (the deployment's secret; "
                         "`tokenmill up` writes one) or mTLS (--tls-client-ca, best with --tls-allowed-clients), "
                         "or type --allow-unauthenticated to let any process that reaches the port call")
    if getattr(config, "backend_tls_cert", ""):
        return
    raise ValueError("no credential for the backends: set --internal-secret-file (the deployment's secret; "
                     "`tokenmill up` writes one) or a client certificate (--backend-tls-cert), "
                     "or type --allow-unauthenticated to call them without credentials")


def internal_secret(config: ServiceProcessConfig) -> str:
    """The secret in the config's --internal-secret-file ('' when it has none); ValueError naming
    the flag when the file is unfit (services/common/internal_secret.py)."""
    path = getattr(config, "internal_secret_file", "")
    return load_secret(path) if path else ""


def registrar(
    servicer: Any, add_to_server: Callable[[Any, grpc.aio.Server], None], pb2_module: ModuleType, service: str
) -> Callable[[grpc.aio.Server], list[str]]:
    """start_server's ``add`` for one generated service: registers ``servicer``, returns its full name."""
    full_name = pb2_module.DESCRIPTOR.services_by_name[service].full_name

    def add(server: grpc.aio.Server) -> list[str]:
        add_to_server(servicer, server)
        return [full_name]

    return add


async def start_service(
    config: ServiceProcessConfig, name: str, add: Callable[[grpc.aio.Server], list[str]], *, serving: bool = False,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    front_interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    app: Any = None,
    method_clients: Mapping[str, Sequence[str]] | None = None,
) -> RunningServer:
    """Bind and start the server on the config's address (health NOT_SERVING unless ``serving``).

    ``interceptors`` run inside the RPC timer (so refused calls are timed too) and inside the
    error mapping (so their errors become statuses); ``front_interceptors`` before both (see
    start_server). ``app``: kept as ``RunningServer.app``. ``method_clients``: identities a method
    takes beside ``tls_allowed_clients`` (peer_identity.py)."""
    check_bind(config, name)
    identity = ([PeerIdentityInterceptor(config.tls_allowed_clients, method_clients)]
                if config.tls_allowed_clients else [])
    if getattr(config, "internal_secret_required", False):
        if secret := internal_secret(config):
            identity.insert(0, InternalSecretInterceptor(secret))
        elif not config.tls_allowed_clients:
            _log.warning("internal_service_unauthenticated", service=name,
                         hint="any local process may call it: set --internal-secret-file (tokenmill up does), or "
                              "mTLS with --tls-allowed-clients")
    return await start_server(name, add, host=config.host, port=config.port, serving=serving,
                              interceptors=[*rpc_interceptors(config.metrics_port), *interceptors],
                              front_interceptors=[*identity, *front_interceptors],
                              options=server_options(config.max_message_bytes),
                              reflection_enabled=config.reflection, tls=ServerTLS.from_config(config), app=app,
                              max_concurrent_rpcs=config.max_concurrent_rpcs, health_port=config.health_port)


async def announce_serving(running: RunningServer, config: ServiceProcessConfig) -> None:
    """Ready: start /metrics, report SERVING, then publish the port file, in that order: whoever
    waits for the port file may connect and scrape at once."""
    serve_metrics(running, config.metrics_port, config.metrics_host)
    await running.set_serving(True)
    publish_port(running, config.port_file)


def service_main(
    name: str,
    config_type: type[ConfigT],
    serve: Callable[[ConfigT], Awaitable[RunningServer]],
    argv: Sequence[str] | None = None,
) -> int:
    """The process entry point: parse flags and TOKENMILL_* variables, check them, configure
    logging, serve until SIGINT/SIGTERM, stop gracefully.

    A config with a ``validate()`` method is checked before anything is bound, connected or
    loaded; a bad value ends the process with exit status 2 and one line naming it, like a
    bad flag does.
    """
    prog = f"tokenmill serve {name}"
    config = parse_config(config_type, argv, prog=prog)
    # Started by `tokenmill up` (or a test's launcher): end when it does, however it ended.
    end_with_parent(grace_s=config.shutdown_grace_seconds + 5.0)
    validate = getattr(config, "validate", None)
    try:
        check_process_fields(config)
        check_bind(config, name, warn=False)  # before a model is loaded; start_service checks again, and warns
        if validate is not None:
            validate()
        check_authenticated(config)  # last: a wrong value is named first, whatever the credentials
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(name, config.log_level)
    set_gc_thresholds(config.gc_young_threshold)
    run_service(lambda: serve(config), grace=config.shutdown_grace_seconds)
    return 0
