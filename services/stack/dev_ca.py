"""A throwaway local certificate authority for ``tokenmill up --tls`` (and tests).

``write_dev_certificates(folder)`` makes a fresh CA and four leaf certificates signed by it,
for ``127.0.0.1``, ``::1`` and ``localhost``: one to serve with (every service presents it), one
for the scheduler to connect to its backends with (common name SCHEDULER_IDENTITY, the only
client the backends accept: --tls-allowed-clients), and one for clients of the public API (the
demo, a developer's grpcurl), which the backends refuse: a user holding it cannot open the
executor's Step session; and one the executors present to each other (EXECUTOR_IDENTITY),
which opens ReadKVBlocks alone (--tls-peer-clients). Keys are P-256, written unencrypted with mode 0600; the CA's
key is never written, so nothing more can be signed by it once the process ends.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("localhost",)
SCHEDULER_IDENTITY = "tokenmill scheduler"
EXECUTOR_IDENTITY = "tokenmill executor"
CLIENT_IDENTITY = "tokenmill client"
LOCAL_IPS = ("127.0.0.1", "::1")
VALIDITY = datetime.timedelta(days=30)
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""Certificates are valid from a little before now, so a peer whose clock is behind accepts them."""


@dataclass(frozen=True, slots=True)
class Authority:
    """A CA in memory: its certificate and the key that signs leaves."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True, slots=True)
class DevCertificates:
    """Paths of the files write_dev_certificates wrote."""

    folder: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    scheduler_cert: Path
    scheduler_key: Path
    executor_cert: Path
    executor_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tokenmill (local)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_authority(common_name: str = "tokenmill local CA") -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(_name(common_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def issue(authority: Authority, common_name: str, *, server: bool = True, client: bool = False,
          dns_names: tuple[str, ...] = LOCAL_NAMES, ips: tuple[str, ...] = LOCAL_IPS,
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate and its key, for serving (server=True) and/or connecting (client=True)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [oid for oid, wanted in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                      (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if wanted]
    alt_names = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(authority.cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
                       critical=False)
    )
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    return builder.sign(authority.key, hashes.SHA256()), key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_file(path: Path, data: bytes, *, private: bool = False) -> None:
    """Write atomically (temp file + rename), so a reader never sees half a PEM file."""
    temp = path.with_name(f".{path.name}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(temp, path)


def write_dev_certificates(folder: str | os.PathLike[str]) -> DevCertificates:
    """A fresh CA, a server certificate and the scheduler's and a client's certificates for
    loopback, in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    authority = make_authority()
    server_cert, server_key = issue(authority, "tokenmill service", server=True)
    client_cert, client_key = issue(authority, CLIENT_IDENTITY, server=False, client=True)
    scheduler_cert, scheduler_key = issue(authority, SCHEDULER_IDENTITY, server=False, client=True)
    executor_cert, executor_key = issue(authority, EXECUTOR_IDENTITY, server=False, client=True)
    files = DevCertificates(folder, folder / "ca.pem", folder / "server.pem", folder / "server-key.pem",
                            folder / "client.pem", folder / "client-key.pem", folder / "scheduler.pem",
                            folder / "scheduler-key.pem", folder / "executor.pem", folder / "executor-key.pem")
    write_file(files.ca, cert_pem(authority.cert))
    write_file(files.server_cert, cert_pem(server_cert))
    write_file(files.server_key, key_pem(server_key), private=True)
    write_file(files.client_cert, cert_pem(client_cert))
    write_file(files.client_key, key_pem(client_key), private=True)
    write_file(files.scheduler_cert, cert_pem(scheduler_cert))
    write_file(files.scheduler_key, key_pem(scheduler_key), private=True)
    write_file(files.executor_cert, cert_pem(executor_cert))
    write_file(files.executor_key, key_pem(executor_key), private=True)
    return files
