"""What every service process shares: its common config fields and the port file.

Each service describes its configuration as one dataclass (parsed by
services/common/settings.py). The fields every service process has come from one base built
here, so their flags, environment variables and help texts are spelled the same way
everywhere and cannot drift apart::

    @dataclass(slots=True)
    class TokenizerConfig(service_process_fields("tokenizer", 50052)):
        model: str = model_field()

The port file is how a launcher (or a test) learns the port the OS picked for ``--port 0``:
it is written once the server reports SERVING, atomically (a reader sees either no file or
the whole number), and removed again when the server stops.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import structlog

from services.common.gc_thresholds import GC_OLDER_THRESHOLD, GC_YOUNG_THRESHOLD
from services.common.logging import LEVELS
from services.common.server import DEFAULT_MAX_CONCURRENT_RPCS, MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from services.common.server import RunningServer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "stories260K"
"""The model shipped with the repository (260K parameters), used when none is configured."""

DEFAULT_HOST = "127.0.0.1"

_log = structlog.get_logger("tokenmill.service")


def _env_prefix(service: str) -> str:
    return f"TOKENMILL_{service.upper()}_"


def host_field(service: str) -> Any:
    return field(
        default=DEFAULT_HOST,
        metadata={"help": "interface to listen on (0.0.0.0 = all)", "env": _env_prefix(service) + "HOST"},
    )


def port_field(service: str, default: int) -> Any:
    return field(
        default=default,
        metadata={"help": "gRPC port (0 = any free port; see --port-file)", "env": _env_prefix(service) + "PORT"},
    )


def port_file_field() -> Any:
    return field(
        default="",
        metadata={"help": "write the bound port to this file once SERVING (empty = don't)", "path": True},
    )


def log_level_field(service: str) -> Any:
    return field(
        default="info",
        metadata={
            "help": f"least severe log level written: {', '.join(LEVELS)}",
            "env": _env_prefix(service) + "LOG_LEVEL",
        },
    )


def shutdown_grace_field(service: str) -> Any:
    return field(
        default=5.0,
        metadata={
            "help": "seconds in-flight calls may still run after SIGTERM",
            "env": _env_prefix(service) + "SHUTDOWN_GRACE_SECONDS",
        },
    )


def metrics_port_field(service: str) -> Any:
    return field(default=-1, metadata={"help": "Prometheus metrics HTTP port (-1 = off, 0 = any free port)",
                                       "env": _env_prefix(service) + "METRICS_PORT"})


def metrics_host_field(service: str) -> Any:
    return field(default=DEFAULT_HOST, metadata={
        "help": "interface /metrics listens on (loopback by default, whatever --host is: the metrics are plaintext "
                "and name tenants)",
        "env": _env_prefix(service) + "METRICS_HOST"})


def max_message_bytes_field(service: str, default: int) -> Any:
    return field(default=default, metadata={
        "help": "largest gRPC message received or sent, in bytes (a larger one is refused with RESOURCE_EXHAUSTED "
                "before it is parsed)",
        "env": _env_prefix(service) + "MAX_MESSAGE_BYTES"})


def path_field(service: str, name: str, help_text: str) -> Any:
    """A file path setting (empty = unset), with the TOKENMILL_<SERVICE>_<NAME> variable."""
    return field(default="", metadata={"help": help_text, "env": _env_prefix(service) + name.upper(), "path": True})


INTERNAL_SECRET_HELP = {
    "require": "file holding the deployment's internal secret (one line, private to its owner; "
               "services/common/internal_secret.py): every call here but health must carry it, else UNAUTHENTICATED, "
               "and calls this service makes to the others carry it (empty = none: any local process may call)",
    "present": "file holding the deployment's internal secret (one line, private to its owner): sent on every call "
               "to the backends, which require it (their --internal-secret-file); empty = none",
}


ALLOW_UNAUTHENTICATED_HELP = {
    "require": "start with neither --internal-secret-file nor mTLS (--tls-client-ca), so that any process that "
               "can reach the port may call (a test or a single-user machine); off: such a start is refused",
    "present": "start with neither --internal-secret-file nor a client certificate for the backends "
               "(--backend-tls-cert), whose calls then carry no credentials; off: such a start is refused",
}


def _with_backend_tls(base: type, service: str) -> type:
    """``base`` plus the client side of a service that connects to others (--backend-tls-*)."""

    @dataclass(slots=True)
    class ServiceProcessFields(base):
        backend_tls_ca: str = path_field(service, "backend_tls_ca", "PEM CA certificate(s) the backends' "
                                         "certificates must chain to (any --backend-tls-* set: TLS to the "
                                         "backends; no CA: the system's roots)")
        backend_tls_cert: str = path_field(service, "backend_tls_cert",
                                           "PEM client certificate presented to the backends (mTLS)")
        backend_tls_key: str = path_field(service, "backend_tls_key", "PEM private key of --backend-tls-cert")

    return ServiceProcessFields


def _with_internal_secret(base: type, service: str, internal_secret: str) -> type:
    """``base`` plus --internal-secret-file and its opt-out ("require": callers must present the
    secret; "present": this service only sends it)."""

    @dataclass(slots=True)
    class ServiceProcessFields(base):
        internal_secret_file: str = path_field(service, "internal_secret_file", INTERNAL_SECRET_HELP[internal_secret])
        allow_unauthenticated: bool = field(default=False, metadata={
            "help": ALLOW_UNAUTHENTICATED_HELP[internal_secret],
            "env": _env_prefix(service) + "ALLOW_UNAUTHENTICATED"})
        internal_secret_required: ClassVar[bool] = internal_secret == "require"

    return ServiceProcessFields


def service_process_fields(service: str, default_port: int, message_limit: int = MAX_MESSAGE_BYTES, *,
                           backend_tls: bool = False, internal_secret: str = "") -> type:
    """A dataclass base with the fields every service process has: where it listens, its port
    file, log level, stop grace, metrics port, message size limit, reflection, TLS, the plaintext
    health port and the garbage collector's young threshold, with TOKENMILL_<SERVICE>_* variables. backend_tls adds
    the client side of a service that connects to others (--backend-tls-ca/-cert/-key). internal_secret adds
    --internal-secret-file: "require" for an internal service (its callers must present it), "present" for
    one that only calls them (the scheduler)."""

    @dataclass(slots=True)
    class ServiceProcessFields:
        host: str = host_field(service)
        port: int = port_field(service, default_port)
        port_file: str = port_file_field()
        log_level: str = log_level_field(service)
        shutdown_grace_seconds: float = shutdown_grace_field(service)
        metrics_port: int = metrics_port_field(service)
        metrics_host: str = metrics_host_field(service)
        max_message_bytes: int = max_message_bytes_field(service, message_limit)
        reflection: bool = field(default=True, metadata={
            "help": "serve gRPC reflection (grpcurl without .proto files); off hides the API's shape",
            "env": _env_prefix(service) + "REFLECTION"})
        tls_cert: str = path_field(service, "tls_cert", "PEM certificate chain to serve TLS with "
                                                        "(empty = plaintext; re-read on SIGHUP)")
        tls_key: str = path_field(service, "tls_key", "PEM private key of --tls-cert")
        tls_client_ca: str = path_field(service, "tls_client_ca", "PEM CA certificate(s): require client "
                                                                  "certificates signed by them (mTLS)")
        tls_allowed_clients: tuple[str, ...] = field(default=(), metadata={
            "help": "with --tls-client-ca: only client certificates naming one of these (common name or DNS "
                    "subject alternative name, comma-separated) may call; others get PERMISSION_DENIED "
                    "(empty = any certificate the CA signed)",
            "env": _env_prefix(service) + "TLS_ALLOWED_CLIENTS"})
        allow_insecure_bind: bool = field(default=False, metadata={
            "help": "listen on a non-loopback --host without mTLS (internal services) or, with bearer tokens, "
                    "without TLS (scheduler); off: such a bind is refused",
            "env": _env_prefix(service) + "ALLOW_INSECURE_BIND"})
        max_concurrent_rpcs: int = field(default=DEFAULT_MAX_CONCURRENT_RPCS, metadata={
            "help": "calls served at once; beyond it RESOURCE_EXHAUSTED before any handler runs (0 = no bound)",
            "env": _env_prefix(service) + "MAX_CONCURRENT_RPCS"})
        health_port: int = field(default=-1, metadata={
            "help": "a second port, plaintext, serving the health service alone: for probes that cannot present a "
                    "client certificate to a TLS port, such as the kubelet's gRPC probes (-1 = none)",
            "env": _env_prefix(service) + "HEALTH_PORT"})
        gc_young_threshold: int = field(default=GC_YOUNG_THRESHOLD, metadata={
            "help": "net allocations between the cyclic garbage collector's young collections (older generations "
                    f"every {GC_OLDER_THRESHOLD}); 0 = Python's defaults (700, 10, 10)",
            "env": _env_prefix(service) + "GC_YOUNG_THRESHOLD"})

    if backend_tls:
        ServiceProcessFields = _with_backend_tls(ServiceProcessFields, service)  # noqa: N806
    if internal_secret:
        ServiceProcessFields = _with_internal_secret(ServiceProcessFields, service, internal_secret)  # noqa: N806

    ServiceProcessFields.__name__ = ServiceProcessFields.__qualname__ = f"{service.capitalize()}ProcessFields"
    return ServiceProcessFields


def model_field(help_text: str = "model directory (Hugging Face layout)") -> Any:
    return field(default=str(DEFAULT_MODEL_DIR), metadata={"help": help_text, "env": "TOKENMILL_MODEL", "path": True})


def write_port_file(path: str | os.PathLike[str], port: int) -> None:
    """Write `port` and a newline to `path` atomically (temp file in the same folder + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(f"{port}\n")
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def remove_port_file(path: str | os.PathLike[str], port: int) -> None:
    """Remove the port file if it still names `port` (a newer server may have replaced it)."""
    target = Path(path)
    try:
        if target.read_text(encoding="ascii").strip() == str(port):
            target.unlink()
    except (FileNotFoundError, ValueError, OSError) as exc:
        _log.debug("port_file_not_removed", path=str(target), reason=str(exc))


def read_port_file(path: str | os.PathLike[str]) -> int | None:
    """The port in a port file, or None while it does not exist yet."""
    try:
        text = Path(path).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    return int(text)


def publish_port(running: RunningServer, port_file: str) -> None:
    """Write the server's port to port_file (when set) and remove it again when the server stops.

    Call once the server reports SERVING: whoever waits for the file may connect at once.
    """
    if not port_file:
        return
    write_port_file(port_file, running.port)
    running.on_stop(lambda: remove_port_file(port_file, running.port))
