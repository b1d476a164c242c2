"""TLS on every hop: a server's certificate (reloadable), a client's credentials, and the checks
that turn a misconfiguration into one line at start.

Server side (every service, ``--tls-cert/--tls-key``, ``--tls-client-ca`` for mTLS):
``ServerCertificates`` builds grpc's *dynamic* server credentials. grpc asks its fetcher for a
new certificate configuration at every new handshake; ``reload()`` (SIGHUP, see
``run_service``) reads and checks the files at once and hands the result to the next
handshake. Connections already open keep the session they negotiated, so streams are not
dropped. Files that fail the checks on reload are logged and the old certificate stays.

Client side (the scheduler's links ``--backend-tls-*``, the stack client ``TOKENMILL_TLS_*``):
``ClientTLS.credentials()`` reads its files each time a channel is created, so a link that
reconnects presents the current client certificate.

The host name a client checks is the address's host: certificates for a loopback stack name
``127.0.0.1`` and ``localhost`` as subject alternative names.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

_log = structlog.get_logger("tokenmill.tls")

CLIENT_ENV = ("TOKENMILL_TLS_CA", "TOKENMILL_TLS_CERT", "TOKENMILL_TLS_KEY")
"""Environment variables of the stack client (``tokenmill generate``, ``profile``, benchmarks):
the CA to trust, and the client certificate and key to present to an mTLS server."""


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None


def _load_certificates(path: str, flag: str) -> tuple[bytes, list[Any]]:
    from cryptography import x509

    data = _read(path, flag)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ValueError(f"{flag} {path}: not a PEM certificate") from None
    return data, certs


def _load_key(path: str, flag: str) -> tuple[bytes, Any]:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read(path, flag)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError(f"{flag} {path}: not an unencrypted PEM private key") from None
    return data, key


def load_key_pair(cert_path: str, key_path: str, cert_flag: str, key_flag: str) -> tuple[bytes, bytes]:
    """(certificate chain PEM, key PEM), checked: both readable and parsed, the key the certificate's."""
    from cryptography.hazmat.primitives import serialization

    if not cert_path:
        raise ValueError(f"{key_flag} needs {cert_flag}")
    if not key_path:
        raise ValueError(f"{cert_flag} needs {key_flag}")
    cert_pem, certs = _load_certificates(cert_path, cert_flag)
    key_pem, key = _load_key(key_path, key_flag)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if certs[0].public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise ValueError(f"{key_flag} {key_path}: not the key of the certificate in {cert_flag} {cert_path}")
    return cert_pem, key_pem


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A server's certificate files; with client_ca, clients must present a certificate it signed."""

    cert: str
    key: str
    client_ca: str = ""

    @classmethod
    def from_config(cls, config: Any) -> ServerTLS | None:
        """From a service config's tls_* fields (service_config.service_process_fields); None: plaintext."""
        if not (config.tls_cert or config.tls_key or config.tls_client_ca):
            return None
        return cls(config.tls_cert, config.tls_key, config.tls_client_ca)

    def load(self) -> grpc.ServerCertificateConfiguration:
        """Read and check the files; ValueError names the flag of the file at fault."""
        if self.client_ca and not (self.cert or self.key):
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        cert_pem, key_pem = load_key_pair(self.cert, self.key, "--tls-cert", "--tls-key")
        client_ca = None
        if self.client_ca:
            client_ca, _ = _load_certificates(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=client_ca)


class ServerCertificates:
    """grpc dynamic server credentials over ServerTLS's files, reloaded on request."""

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.reloads = 0
        """How many reloads a handshake has picked up."""
        self.credentials = grpc.dynamic_ssl_server_credentials(
            tls.load(), self._fetch, require_client_authentication=bool(tls.client_ca))

    def reload(self) -> bool:
        """Re-read the files now; the next new connection is served with them. On a bad file
        the error is logged and the current certificate stays (returns False)."""
        try:
            config = self.tls.load()
        except ValueError as exc:
            _log.error("tls_reload_failed", error=str(exc))
            return False
        with self._lock:
            self._pending = config
        _log.info("tls_reloaded", cert=self.tls.cert, client_ca=self.tls.client_ca or None)
        return True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by grpc at each new handshake, from one of its threads; None keeps the current one.
        with self._lock:
            config, self._pending = self._pending, None
        if config is not None:
            self.reloads += 1
        return config


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """How a client connects over TLS: the CA to trust (empty: the system's roots) and, for an
    mTLS server, the certificate and key to present."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientTLS | None:
        """From TOKENMILL_TLS_CA / _CERT / _KEY; None when none is set (plaintext)."""
        env = os.environ if environ is None else environ
        ca, cert, key = (env.get(name, "") for name in CLIENT_ENV)
        return cls(ca, cert, key) if (ca or cert or key) else None

    @classmethod
    def for_backends(cls, config: Any) -> ClientTLS | None:
        """From a config's backend_tls_* fields (service_process_fields(backend_tls=True)); None when
        the config has none or sets none (plaintext to the backends)."""
        names = ("backend_tls_ca", "backend_tls_cert", "backend_tls_key")
        ca, cert, key = (getattr(config, name, "") for name in names)
        return cls(ca, cert, key) if (ca or cert or key) else None

    def check(self, flags: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key")) -> None:
        """Read and check the files; ValueError names the flag of the file at fault."""
        ca_flag, cert_flag, key_flag = flags
        if self.ca:
            _load_certificates(self.ca, ca_flag)
        if self.cert or self.key:
            load_key_pair(self.cert, self.key, cert_flag, key_flag)

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files as they are now."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA certificate") if self.ca else None,
            private_key=_read(self.key, "client key") if self.key else None,
            certificate_chain=_read(self.cert, "client certificate") if self.cert else None)
