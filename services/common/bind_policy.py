"""Which addresses a service may listen on without the protection its port needs.

An internal service (tokenizer, executor, drafter) trusts whoever opens its streams: the one
Step session of an executor decides which blocks a sequence attends over, so on a port others
can reach it must require client certificates (mTLS, ``--tls-client-ca``, and
``--tls-allowed-clients`` to name who). The scheduler's public port with bearer tokens must
not carry them in plaintext. Off loopback either is refused before the port is bound, unless
``--allow-insecure-bind`` says the network is trusted (a pod's own interface, say); on
loopback plaintext bearer tokens are allowed with a warning.
"""

from __future__ import annotations

import ipaddress

import structlog

_log = structlog.get_logger("tokenmill.service")

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """True for loopback addresses and names; False for wildcards (0.0.0.0, ::) and the rest."""
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to may be reachable


def check_bind(config, service: str, warn: bool = True) -> None:
    """Raise ValueError naming the flags when ``service`` would listen off loopback without the
    protection its port needs (see the module docstring); warn (``warn``) where it is allowed
    but weak."""
    host = config.host
    tls = bool(config.tls_cert)
    mtls = tls and bool(config.tls_client_ca)
    bearer = bool(getattr(config, "auth_tokens_file", ""))
    loopback = is_loopback(host)
    allowed = getattr(config, "allow_insecure_bind", False)
    if service == "scheduler":
        if bearer and not tls:
            if not loopback and not allowed:
                raise ValueError(f"{service}: --host {host} with --auth-tokens-file and no --tls-cert would carry "
                                 "bearer tokens in plaintext; serve TLS, bind loopback, or pass --allow-insecure-bind")
            if warn:
                _log.warning("bearer_tokens_over_plaintext", host=host,
                             hint="anyone on the path reads the tokens: serve TLS (--tls-cert/--tls-key)")
        elif not loopback and not tls and warn:
            _log.warning("public_port_plaintext", host=host)
        return
    if not loopback and not mtls and not allowed:
        raise ValueError(f"{service}: --host {host} without client certificates (--tls-cert and --tls-client-ca) "
                         f"would let anyone who reaches the port drive the {service}; require mTLS, bind loopback, "
                         "or pass --allow-insecure-bind")
    if not loopback and not mtls and warn:
        _log.warning("internal_port_without_mtls", service=service, host=host)
