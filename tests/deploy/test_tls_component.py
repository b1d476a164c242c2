"""components/tls, rendered over the overlays: every gRPC hop is TLS from each service's own Secret
tokenmill-tls-SERVICE (mTLS between the services; TLS without client certificates on the gateway's public port), the
clients (gateway, schedulers) present the client certificate to their backends, and the probes
ask each service's plaintext health-only port, which serves nothing else. Each server names the
client identities it takes: the scheduler the gateway's, every backend the scheduler's alone (an
executor's ReadKVBlocks also its peers'), so the gateway's certificate cannot drive a backend."""

from __future__ import annotations

import posixpath

import pytest

from tests.deploy.manifests import COMPOSED, all_containers, by_kind, one, parse_container, pod_spec, service_module

TLS_VARIANTS = [name for name, (_, components) in COMPOSED.items() if "tls" in components]
ALLOWED = {"scheduler": ("tokenmill-gateway",), "executor": ("tokenmill-scheduler",),
           "tokenizer": ("tokenmill-scheduler",), "drafter": ("tokenmill-scheduler",)}
"""The identities (certificate common names) each server takes; the gateway's public port asks for none."""


def secret_of(module: str) -> str:
    return f"tokenmill-tls-{module}"


def _env(docs: list[dict], container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    env.update({item["name"]: str(item["value"]) for item in container.get("env", []) if "value" in item})
    return env


def _secret_folders(workload: dict, container: dict, secret: str) -> set[str]:
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return {m["mountPath"] for m in container.get("volumeMounts", [])
            if volumes[m["name"]].get("secret", {}).get("secretName") == secret}


def _tls_secrets(workload: dict, container: dict) -> set[str]:
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return {volumes[m["name"]]["secret"]["secretName"] for m in container.get("volumeMounts", [])
            if volumes[m["name"]].get("secret", {}).get("secretName", "").startswith("tokenmill-tls")}


@pytest.mark.parametrize("variant", TLS_VARIANTS, ids=[f"overlays/{v}" for v in TLS_VARIANTS])
def test_every_hop_is_tls_from_the_secret(rendered, variant):
    docs = rendered[variant]
    seen = set()
    for workload in [*by_kind(docs, "Deployment"), *by_kind(docs, "StatefulSet")]:
        for container in all_containers(pod_spec(workload)):
            module = service_module(container)
            seen.add(module)
            config, _ = parse_container(module, container.get("args", []), _env(docs, container))
            folders = _secret_folders(workload, container, secret_of(module))
            files = {"tls.crt", "tls.key", "ca.crt"}

            def from_secret(path: str) -> bool:
                return posixpath.dirname(path) in folders and posixpath.basename(path) in files

            who = f"{variant}: {container['name']}"
            assert from_secret(config.tls_cert) and from_secret(config.tls_key), who
            # Public clients of the gateway hold no certificate; every other server asks for one.
            assert (config.tls_client_ca == "") if module == "gateway" else from_secret(config.tls_client_ca), who
            if module in ("gateway", "scheduler"):
                assert all(from_secret(getattr(config, f"backend_tls_{k}")) for k in ("ca", "cert", "key")), who
            # Its own certificate alone: no container holds another service's key.
            assert _tls_secrets(workload, container) == {secret_of(module)}, who
            assert config.tls_allowed_clients == ALLOWED.get(module, ()), who
            if module == "executor":
                assert config.tls_peer_clients == ("tokenmill-executor",), who
                assert all(from_secret(getattr(config, f"backend_tls_{k}")) for k in ("ca", "cert", "key")), who
            assert config.health_port > 0 and config.health_port != config.port, who
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in container:
                    assert container[kind]["grpc"]["port"] == config.health_port, (who, kind)
    assert seen == {"gateway", "scheduler", "executor", "tokenizer", "drafter"}


@pytest.mark.parametrize("variant", TLS_VARIANTS, ids=[f"overlays/{v}" for v in TLS_VARIANTS])
def test_no_policy_opens_a_health_port_to_other_pods(rendered, variant):
    docs = rendered[variant]
    health_ports = set()
    for workload in [*by_kind(docs, "Deployment"), *by_kind(docs, "StatefulSet")]:
        for container in all_containers(pod_spec(workload)):
            config, _ = parse_container(service_module(container), container.get("args", []), _env(docs, container))
            health_ports.add(config.health_port)
    opened = {port["port"] for policy in by_kind(docs, "NetworkPolicy")
              for rule in policy["spec"].get("ingress", []) for port in rule.get("ports", [])}
    assert not health_ports & opened
