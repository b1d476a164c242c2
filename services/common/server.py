"""The gRPC server bootstrap every tokenmill service uses, and the process entry point.

A service's ``main`` is three lines::

    async def serve(config: TokenizerConfig) -> RunningServer:
        servicer = TokenizerServicer(...)
        def add(server):
            tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
            return [tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name]
        running = await start_server("tokenizer", add, host=config.host, port=config.port)
        running.on_stop(servicer.close)
        return running

    run_service(lambda: serve(config), grace=config.shutdown_grace_seconds)

Every server gets the error-mapping interceptor (services/common/errors.py), the standard
health service (each registered service and "" report SERVING once started), server
reflection (grpcurl works without .proto files), 64 MiB message limits and keepalive
settings that match ``create_channel``'s, so long-lived step streams survive idle periods
and dead peers are noticed within tens of seconds. With ``tls`` (services/common/tls.py) the
port is TLS only (mTLS when the config names a client CA), and ``create_channel`` connects
with a ``ClientTLS``; a ``health_port`` then answers health checks (and nothing else) in
plaintext, for probes that cannot present a client certificate (the kubelet's gRPC probes).

Stopping, in order: health flips to NOT_SERVING (watchers and load balancers see it),
an optional drain period while still accepting calls, the ``on_stopping`` hooks, then the server
refuses new calls and gives in-flight ones what is left of ``grace`` (one grace for the hooks and
the calls together) before cancelling them, then the ``on_stop`` callbacks run (newest first). ``run_service`` does this on SIGINT/SIGTERM; a second
signal cuts the grace period short. On SIGHUP it reloads a TLS server's certificate files
(new connections get them; open ones keep theirs) and runs the ``on_reload`` callbacks.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ErrorMappingInterceptor, UnavailableError
from services.common.server_hooks import ServerHooks
from services.common.tls import ClientTLS, ServerCertificates, ServerTLS

_log = structlog.get_logger("tokenmill.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message either way; a step of thousands of sequences is well under 1 MiB."""

KEEPALIVE_TIME_MS = 30_000
"""Clients ping an idle connection this often, so a dead peer is noticed without traffic."""

KEEPALIVE_TIMEOUT_MS = 10_000
"""A ping unanswered for this long closes the connection."""

MIN_PING_INTERVAL_MS = 10_000
"""Servers accept client pings this often (must be below KEEPALIVE_TIME_MS, or the server
answers the pings with GOAWAY "too_many_pings")."""

FINAL_WRITES_S = 1.0
"""After the on_stopping hooks took the grace, calls still get this long to send what the hooks
ended them with (the scheduler's last Finished) before the server cancels them."""

MAX_PING_STRIKES = 2
"""Pings more frequent than MIN_PING_INTERVAL_MS a server tolerates before it closes the
connection (gRPC's default): without a bound, a client could ping as fast as it sends."""

DEFAULT_MAX_CONCURRENT_RPCS = 16_384
"""Calls a server runs at once; more are refused RESOURCE_EXHAUSTED by gRPC before a handler
runs. Far above what the scheduler's own bounds admit (waiting + running requests)."""

Servicers = Callable[[grpc.aio.Server], Sequence[str]]
"""Registers servicers on the server; returns the full names of the services it added."""


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        # Without this, two servers can bind the same fixed port and split its traffic;
        # a clash must fail loudly instead.
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def create_channel(address: str, *, options: Sequence[tuple[str, Any]] | None = None,
                   tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """An asyncio channel with the options our servers expect ("host:port"): plaintext, or TLS
    verifying the server against ``tls.ca`` (and presenting ``tls.cert`` for mTLS). The files
    are read now, so a channel created after a rotation uses the new ones."""
    options = list(options) if options is not None else channel_options()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


def format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


@dataclass(eq=False)
class RunningServer:
    """A started server. Create with start_server; stop with stop()."""

    name: str
    server: grpc.aio.Server
    host: str
    port: int
    """The bound port (the one the OS chose when started with port 0)."""
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    """The application's services (health and reflection not included)."""
    tls: ServerCertificates | None = None
    """The server's certificates when it serves TLS (None: plaintext)."""
    app: Any = None
    """What the service runs behind its servicer (the scheduler's Supervisor, the executor's
    model runner), for metrics and for tests that run a service in their own process."""
    health_server: grpc.aio.Server | None = None
    """The plaintext health-only server (start_server's health_port), stopped last."""
    health_port: int | None = None
    hooks: ServerHooks = field(default_factory=ServerHooks)
    _stop_task: asyncio.Task | None = None

    def __post_init__(self) -> None:  # a service registers its callbacks on the server (server_hooks.py)
        hooks = self.hooks
        self.on_stop, self.on_stopping, self.on_reload = hooks.on_stop, hooks.on_stopping, hooks.on_reload

    def reload_tls(self) -> bool:
        """Re-read the certificate files for new connections; False without TLS or when they are bad
        (the current certificate stays, the error is logged)."""
        return self.tls.reload() if self.tls is not None else False

    def reload(self) -> None:
        """What SIGHUP does: re-read the TLS files, then run the reload callbacks."""
        self.reload_tls()
        self.hooks.run_reloads(self.name)

    @property
    def address(self) -> str:
        """Where clients connect; a wildcard host is reported as loopback."""
        host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return format_address(host, self.port)

    async def set_serving(self, serving: bool = True) -> None:
        """Report every service and "" as SERVING (or NOT_SERVING) to health checks."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service_name in (*self.service_names, health.OVERALL_HEALTH):
            await self.health.set(service_name, status)

    async def stop(self, grace: float = 5.0, *, drain_seconds: float = 0.0) -> None:
        """Stop gracefully (``stop_in_order``); safe to call more than once (later calls wait for the first)."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(stop_in_order(self, grace, drain_seconds))
        await asyncio.shield(self._stop_task)

    async def wait_for_termination(self) -> None:
        """Return once the server stopped. Safe to cancel: grpc.aio's own wait_for_termination awaits
        the server's internal shutdown future directly, so cancelling it would cancel that future and
        make a later stop() cancel every in-flight call at once; the shield keeps the cancellation out."""
        await asyncio.shield(self.server.wait_for_termination())


async def stop_in_order(running: RunningServer, grace: float, drain_seconds: float) -> None:
    """Health NOT_SERVING, the drain, the on_stopping hooks, the calls, the health port, the
    on_stop callbacks. drain_seconds: keep accepting calls this long after health turns
    NOT_SERVING, for load balancers that poll health. grace: how long in-flight calls may still run."""
    _log.info("server_stopping", server=running.name, grace_s=grace, drain_s=drain_seconds)
    await running.health.enter_graceful_shutdown()
    if drain_seconds > 0:
        await asyncio.sleep(drain_seconds)
    # One grace for the whole stop: what the on_stopping hooks spend (the scheduler waits
    # there for its streams to finish) is not given again to the calls, so the process ends
    # within the grace an orchestrator's termination period was sized for.
    deadline = time.monotonic() + grace
    await running.hooks.run_stopping(running.name, deadline)
    remaining = deadline - time.monotonic()
    await running.server.stop(max(remaining, min(grace, FINAL_WRITES_S)))
    if running.health_server is not None:  # NOT_SERVING to the probes until the calls are over
        await running.health_server.stop(0)
    await running.hooks.run_stopped(running.name)
    _log.info("server_stopped", server=running.name)


async def start_server(
    name: str,
    add_servicers: Servicers,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    front_interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] | None = None,
    serving: bool = True,
    reflection_enabled: bool = True,
    tls: ServerTLS | None = None,
    app: Any = None,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
    health_port: int = -1,
) -> RunningServer:
    """Build, bind and start a server; with serving=True health reports SERVING on return.

    name: for logs. add_servicers: registers the application's servicers and returns their
    full service names ("tokenmill.v1.Tokenizer"). port: 0 lets the OS pick a free port
    (read it from the result). interceptors run inside the error-mapping interceptor, so
    their exceptions are mapped too. front_interceptors run first, outside the error mapping,
    for answers that must cost nothing more (the scheduler's door refusing a burst); they answer
    with statuses of their own. options replace server_options() entirely.
    serving=False starts with every service NOT_SERVING, for a service that must finish
    warming up after binding; call set_serving() when ready. reflection_enabled=False leaves
    server reflection out (callers then need the .proto files). tls: serve TLS only (its files
    are read here; a bad one raises ValueError naming the flag). app: kept as
    ``RunningServer.app``. max_concurrent_rpcs: calls run at once (0 = no bound). health_port
    >= 0: a second server on host:health_port, plaintext, with the same health service alone
    (0 = any free port; ``RunningServer.health_port``).
    """
    server = grpc.aio.server(
        interceptors=[*front_interceptors, ErrorMappingInterceptor(), *interceptors],
        options=list(options) if options is not None else server_options(),
        maximum_concurrent_rpcs=max_concurrent_rpcs or None,
    )
    service_names, health_servicer = _add_services(server, add_servicers, reflection_enabled)
    certificates = ServerCertificates(tls) if tls is not None else None
    bound_port = _bind(name, server, format_address(host, port), certificates)
    running = RunningServer(name, server, host, bound_port, health_servicer, service_names, tls=certificates, app=app)
    if health_port >= 0:
        running.health_server = grpc.aio.server(options=server_options())
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, running.health_server)
        running.health_port = _bind(name, running.health_server, format_address(host, health_port), None,
                                    note=" (health port)")
    await running.set_serving(False)
    if running.health_server is not None:
        await running.health_server.start()
    await server.start()
    if serving:
        await running.set_serving(True)
    _log.info("server_started", server=name, address=format_address(host, bound_port), services=list(service_names),
              tls="mtls" if tls is not None and tls.client_ca else "tls" if tls is not None else "off")
    return running


def _add_services(server: grpc.aio.Server, add_servicers: Servicers,
                  reflection_enabled: bool) -> tuple[tuple[str, ...], health.aio.HealthServicer]:
    """The application's servicers, health and (when enabled) reflection on ``server``: the
    application's full service names and the health servicer."""
    service_names = tuple(add_servicers(server))
    if not all(isinstance(n, str) and n for n in service_names):
        raise ValueError(f"add_servicers must return full service names, got {service_names!r}")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_enabled:
        reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return service_names, health_servicer


def _bind(name: str, server: grpc.aio.Server, address: str, certificates: ServerCertificates | None, *,
          note: str = "") -> int:
    """The port ``server`` listens on at ``address`` (TLS with ``certificates``); UnavailableError
    naming the server, the address and ``note`` when it cannot."""
    try:
        if certificates is not None:
            bound_port = server.add_secure_port(address, certificates.credentials)
        else:
            bound_port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises when the bind fails
        raise UnavailableError(f"{name}: cannot listen on {address}{note}: {exc}") from exc
    if bound_port == 0:  # older grpc versions report a failed bind as port 0
        raise UnavailableError(f"{name}: cannot listen on {address}{note}")
    return bound_port


MainFunction = Callable[[], Awaitable[RunningServer]] | Coroutine[Any, Any, RunningServer]


def run_service(main: MainFunction, *, grace: float = 5.0, drain_seconds: float = 0.0, use_uvloop: bool = True) -> None:
    """Run a service process until SIGINT/SIGTERM or server termination, then stop gracefully.
    On SIGHUP (from when it has started) a TLS server reloads its certificate files and every
    server runs its reload callbacks (RunningServer.reload).

    main: a coroutine (or a function returning one) that starts the server and returns
    it; everything else the service owns is cleaned up by its on_stop callbacks. Objects
    alive after start-up (weights, tables) are frozen out of the garbage collector, so
    later collections do not walk them on the step path.
    """

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        running: RunningServer | None = None
        signals_seen = 0

        def on_signal(sig: signal.Signals) -> None:
            nonlocal signals_seen
            signals_seen += 1
            _log.info("signal_received", signal=sig.name, count=signals_seen)
            stop_requested.set()
            if signals_seen > 1 and running is not None:
                # A second signal means "now": cancel the calls still inside their grace.
                asyncio.ensure_future(running.server.stop(0))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            running = await (main() if callable(main) else main)
            loop.add_signal_handler(signal.SIGHUP, running.reload)
            gc.freeze()
            if stop_requested.is_set():  # a signal arrived during start-up
                await running.stop(grace, drain_seconds=drain_seconds)
                return
            waiters = {
                asyncio.ensure_future(stop_requested.wait()),
                asyncio.ensure_future(running.wait_for_termination()),
            }
            _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await running.stop(grace, drain_seconds=drain_seconds)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    if use_uvloop:
        import uvloop

        uvloop.run(runner())
    else:
        asyncio.run(runner())
