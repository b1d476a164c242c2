"""What every service process shares: its common config fields and the port file.

Each service describes its configuration as one dataclass (parsed by
services/common/settings.py). The fields every service process has come from one base built
here, so their flags, environment variables and help texts are spelled the same way
everywhere and cannot drift apart::

    @dataclass(slots=True)
    class TokenizerConfig(service_process_fields("tokenizer", 50052)):
        model: str = setting(str(DEFAULT_MODEL_DIR), env="TOKENMILL_MODEL", path=True)
        '''model directory holding tokenizer.json'''

The port file is how a launcher (or a test) learns the port the OS picked for ``--port 0``:
it is written once the server reports SERVING, atomically (a reader sees either no file or
the whole number), and removed again when the server stops.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import structlog

from services.common.gc_thresholds import GC_YOUNG_THRESHOLD
from services.common.logging import LEVELS
from services.common.server import DEFAULT_MAX_CONCURRENT_RPCS, MAX_MESSAGE_BYTES
from services.common.settings import setting

if TYPE_CHECKING:
    from services.common.server import RunningServer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "stories260K"
"""The model shipped with the repository (260K parameters), used when none is configured."""

DEFAULT_HOST = "127.0.0.1"

_log = structlog.get_logger("tokenmill.service")


def _env_prefix(service: str) -> str:
    return f"TOKENMILL_{service.upper()}_"


def service_process_fields(service: str, default_port: int, message_limit: int = MAX_MESSAGE_BYTES, *,
                           backend_tls: bool = False, internal_secret: str = "") -> type:
    """A dataclass base with the fields every service process has: where it listens, its port
    file, log level, stop grace, metrics port, message size limit, reflection, TLS, the plaintext
    health port and the garbage collector's young threshold, with TOKENMILL_<SERVICE>_* variables. backend_tls adds
    the client side of a service that connects to others (--backend-tls-ca/-cert/-key). internal_secret adds
    --internal-secret-file: "require" for an internal service (its callers must present it), "present" for
    one that only calls them (the scheduler).

    Declared like every other setting (services/common/settings.py): ``setting`` and the
    docstring under the field. Each part is a class of its own name, so its source (and with it
    each field's docstring) can be found; the base returned is named
    ``<Service>ProcessFields``."""
    prefix = _env_prefix(service)
    base: type = _process_fields(prefix, default_port, message_limit)
    if backend_tls:
        base = _with_backend_tls(base, prefix)
    if internal_secret:
        base = _with_internal_secret(base, prefix, internal_secret)
    # A named subclass, adding no field: the parts keep the names their source has.
    return type(f"{service.capitalize()}ProcessFields", (base,), {"__slots__": ()})


def _process_fields(prefix: str, default_port: int, message_limit: int) -> type:
    """The fields of every service process, under the variables ``prefix``NAME."""

    @dataclass(slots=True)
    class _ProcessFields:
        host: str = setting(DEFAULT_HOST, env=prefix + "HOST")
        """interface to listen on (0.0.0.0 = all)"""
        port: int = setting(default_port, env=prefix + "PORT")
        """gRPC port (0 = any free port; see --port-file)"""
        port_file: str = setting("", path=True)
        """write the bound port to this file once SERVING (empty = don't)"""
        log_level: str = setting("info", env=prefix + "LOG_LEVEL", choices=LEVELS)
        """least severe log level written"""
        shutdown_grace_seconds: float = setting(5.0, env=prefix + "SHUTDOWN_GRACE_SECONDS")
        """seconds in-flight calls may still run after SIGTERM"""
        metrics_port: int = setting(-1, env=prefix + "METRICS_PORT")
        """Prometheus metrics HTTP port (-1 = off, 0 = any free port)"""
        metrics_host: str = setting(DEFAULT_HOST, env=prefix + "METRICS_HOST")
        """interface /metrics listens on (loopback by default, whatever --host is: the metrics are plaintext and
        name tenants)"""
        max_message_bytes: int = setting(message_limit, env=prefix + "MAX_MESSAGE_BYTES")
        """largest gRPC message received or sent, in bytes (a larger one is refused with RESOURCE_EXHAUSTED before
        it is parsed)"""
        reflection: bool = setting(True, env=prefix + "REFLECTION")
        """serve gRPC reflection (grpcurl without .proto files); off hides the API's shape"""
        tls_cert: str = setting("", env=prefix + "TLS_CERT", path=True)
        """PEM certificate chain to serve TLS with (empty = plaintext; re-read on SIGHUP)"""
        tls_key: str = setting("", env=prefix + "TLS_KEY", path=True)
        """PEM private key of --tls-cert"""
        tls_client_ca: str = setting("", env=prefix + "TLS_CLIENT_CA", path=True)
        """PEM CA certificate(s): require client certificates signed by them (mTLS)"""
        tls_allowed_clients: tuple[str, ...] = setting((), env=prefix + "TLS_ALLOWED_CLIENTS")
        """with --tls-client-ca: only client certificates naming one of these (common name or DNS subject
        alternative name, comma-separated) may call; others get PERMISSION_DENIED (empty = any certificate the CA
        signed)"""
        allow_insecure_bind: bool = setting(False, env=prefix + "ALLOW_INSECURE_BIND")
        """listen on a non-loopback --host without mTLS (internal services) or, with bearer tokens, without TLS
        (scheduler); off: such a bind is refused"""
        max_concurrent_rpcs: int = setting(DEFAULT_MAX_CONCURRENT_RPCS, env=prefix + "MAX_CONCURRENT_RPCS")
        """calls served at once; beyond it RESOURCE_EXHAUSTED before any handler runs (0 = no bound)"""
        health_port: int = setting(-1, env=prefix + "HEALTH_PORT")
        """a second port, plaintext, serving the health service alone: for probes that cannot present a client
        certificate to a TLS port, such as the kubelet's gRPC probes (-1 = none)"""
        gc_young_threshold: int = setting(GC_YOUNG_THRESHOLD, env=prefix + "GC_YOUNG_THRESHOLD")
        """net allocations between the cyclic garbage collector's young collections (older generations at the fixed
        ratio services/common/gc_thresholds.py sets); 0 = Python's defaults (700, 10, 10)"""

    return _ProcessFields


def _with_backend_tls(base: type, prefix: str) -> type:
    """``base`` plus the client side of a service that connects to others (--backend-tls-*)."""

    @dataclass(slots=True)
    class _BackendTlsFields(base):
        backend_tls_ca: str = setting("", env=prefix + "BACKEND_TLS_CA", path=True)
        """PEM CA certificate(s) the backends' certificates must chain to (any --backend-tls-* set: TLS to the
        backends; no CA: the system's roots)"""
        backend_tls_cert: str = setting("", env=prefix + "BACKEND_TLS_CERT", path=True)
        """PEM client certificate presented to the backends (mTLS)"""
        backend_tls_key: str = setting("", env=prefix + "BACKEND_TLS_KEY", path=True)
        """PEM private key of --backend-tls-cert"""

    return _BackendTlsFields


def _with_internal_secret(base: type, prefix: str, internal_secret: str) -> type:
    """``base`` plus --internal-secret-file and its opt-out ("require": callers must present the
    secret; "present": this service only sends it)."""

    @dataclass(slots=True)
    class _InternalSecretRequired(base):
        internal_secret_file: str = setting("", env=prefix + "INTERNAL_SECRET_FILE", path=True)
        """file holding the deployment's internal secret (one line, private to its owner;
        services/common/internal_secret.py): every call here but health must carry it, else UNAUTHENTICATED, and
        calls this service makes to the others carry it (empty = none: any local process may call)"""
        allow_unauthenticated: bool = setting(False, env=prefix + "ALLOW_UNAUTHENTICATED")
        """start with neither --internal-secret-file nor mTLS (--tls-client-ca), so that any process that can reach
        the port may call (a test or a single-user machine); off: such a start is refused"""
        internal_secret_required: ClassVar[bool] = True

    @dataclass(slots=True)
    class _InternalSecretPresent(base):
        internal_secret_file: str = setting("", env=prefix + "INTERNAL_SECRET_FILE", path=True)
        """file holding the deployment's internal secret (one line, private to its owner): sent on every call to the
        backends, which require it (their --internal-secret-file); empty = none"""
        allow_unauthenticated: bool = setting(False, env=prefix + "ALLOW_UNAUTHENTICATED")
        """start with neither --internal-secret-file nor a client certificate for the backends (--backend-tls-cert),
        whose calls then carry no credentials; off: such a start is refused"""
        internal_secret_required: ClassVar[bool] = False

    return {"require": _InternalSecretRequired, "present": _InternalSecretPresent}[internal_secret]


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
