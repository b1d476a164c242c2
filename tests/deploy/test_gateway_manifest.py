"""The gateway's manifests, rendered: its routes file names every engine replica the autoscaler may
start, by the StatefulSet pods' DNS names; the file is where --config reads it; its Service
exposes both APIs; its drain outlasts the engines' so it never cuts a stream an engine finishes.
"""

from __future__ import annotations

import posixpath

import pytest
import yaml

from tests.deploy.manifests import VARIANTS, by_kind, one, parse_container, pod_spec

each_overlay = pytest.mark.parametrize("overlay", VARIANTS, ids=[f"overlays/{o}" for o in VARIANTS])


def _gateway(docs: list[dict]):
    workload = one(docs, "Deployment", "tokenmill-gateway")
    (container,) = pod_spec(workload)["containers"]
    config, _ = parse_container("gateway", container["args"], {})
    return workload, container, config


def _routes(docs: list[dict], workload: dict, container: dict, config) -> dict:
    """The routes file the gateway's --config names, read from the ConfigMap mounted there."""
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    folder, name = posixpath.split(config.config)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    source = volumes[mount["name"]]["configMap"]["name"]
    data = one(docs, "ConfigMap", source)["data"]
    assert name in data, (config.config, sorted(data))
    return yaml.safe_load(data[name])


@each_overlay
def test_routes_name_every_replica_the_autoscaler_may_start(rendered, overlay):
    from services.gateway.routes_file import parse_routes
    from services.gateway.routing.build import build_route
    from services.gateway.routing.target import TargetState

    docs = rendered[overlay]
    workload, container, config = _gateway(docs)
    routes = parse_routes(_routes(docs, workload, container, config), "routes ConfigMap")
    states = {t.name: TargetState(t.name) for t in routes.targets}
    for model in routes.models.values():
        build_route(model, states)  # every target a route names exists
    engine = one(docs, "StatefulSet", "tokenmill-engine")
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    service = one(docs, "Service", engine["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # per-pod DNS names
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
    replicas = [f"tokenmill-engine-{i}.{service['metadata']['name']}:{port}"
                for i in range(hpa["spec"]["maxReplicas"])]
    assert [t.address for t in routes.targets] == replicas
    routed = {leaf.name for model in routes.models.values() for leaf in build_route(model, states).node.leaves()}
    assert routed == {t.name for t in routes.targets}, "a replica no model routes to"


@each_overlay
def test_gateway_service_and_budget(rendered, overlay):
    docs = rendered[overlay]
    workload, container, config = _gateway(docs)
    service = one(docs, "Service", "tokenmill-gateway")
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    exposed = {p["name"]: named[p["targetPort"]] for p in service["spec"]["ports"]}
    assert exposed == {"http": config.http_port, "grpc": config.port}
    pdb = one(docs, "PodDisruptionBudget", "tokenmill-gateway")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    assert workload["spec"]["replicas"] >= 2  # a drain or a node loss leaves one serving


@each_overlay
def test_gateway_drain_outlasts_the_engines(rendered, overlay):
    """A stream the engine finishes within its drain is not cut by the gateway's."""
    docs = rendered[overlay]
    _, _, gateway = _gateway(docs)
    (scheduler_container,) = pod_spec(one(docs, "StatefulSet", "tokenmill-engine"))["containers"]
    scheduler, _ = parse_container("scheduler", scheduler_container["args"], {})
    assert gateway.shutdown_grace_seconds >= scheduler.shutdown_grace_seconds


@each_overlay
def test_the_gateway_is_never_keyless(rendered, overlay):
    """Without engine tenants every request needs one of the gateway's API keys, from a Secret
    the user creates (not optional: no pod starts without it); with components/auth the engines'
    tenants authenticate the clients' tokens, which the gateway passes on."""
    docs = rendered[overlay]
    workload, container, _ = _gateway(docs)
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    config, _ = parse_container("gateway", container["args"], env)
    (scheduler,) = [c for c in pod_spec(one(docs, "StatefulSet", "tokenmill-engine"))["containers"]
                    if c["name"] == "scheduler"]
    engine_auth = any(e["name"] == "TOKENMILL_AUTH_TOKENS_FILE" and e.get("value") for e in scheduler.get("env", []))
    if engine_auth:
        assert config.api_keys_file == ""
        return
    folder = posixpath.dirname(config.api_keys_file)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    secret = {v["name"]: v for v in pod_spec(workload)["volumes"]}[mount["name"]]["secret"]
    assert secret["secretName"] == "tokenmill-gateway-keys" and not secret.get("optional")
    assert secret["defaultMode"] & 0o007 == 0  # the gateway refuses a keys file others may read
