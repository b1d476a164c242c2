"""The Kubernetes manifests, rendered: schema-valid for the stated Kubernetes version, and saying
what the services read. Every overlay renders with ``kubectl kustomize`` and passes
``kubernetes-validate --strict``; every container's args and env parse with the service's own
settings (an unknown flag or variable fails); ports, probes, drain timings, network policies,
the autoscaler's target and the pods' user agree with one another and with the Dockerfile.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import (
    VARIANTS, WILDCARD_HOSTS, ManifestError, all_containers, by_kind, one, parse_container, pod_spec, prestop_seconds,
    service_module, sidecars,
)

KUBERNETES_VERSION = "1.34.0"
"""The oldest Kubernetes the manifests are checked against (and so need): the preStop sleep action
and native gRPC probes are GA there. kubernetes-validate bundles its schemas (no network)."""
NEWEST_VERSION = "1.37.0"
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
"""The Prometheus Operator's kinds: no bundled schema; tests/deploy/test_autoscaling.py checks them."""
PROCESS_ENV = {"OMP_NUM_THREADS"}
"""Variables a container may set that no tokenmill setting declares (read by the libraries)."""
DRAIN_MARGIN_S = 5.0
"""What a pod keeps between its last service's grace and the kubelet's SIGKILL (the stop itself)."""
DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
each_overlay = pytest.mark.parametrize("overlay", VARIANTS, ids=[f"overlays/{o}" for o in VARIANTS])
"""(ids not the bare names: a test whose keywords hold "gpu" counts as needing a CUDA device)"""


def _workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _containers(docs: list[dict]):
    for workload in _workloads(docs):
        for container in all_containers(pod_spec(workload)):
            yield workload, container


def _env(docs: list[dict], container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for item in container.get("env", []):
        env[item["name"]] = str(item.get("value", "<from a secret>"))
    return env


def _validate(path: Path, version: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(path)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a kubernetes-validate process per overlay and version, a few seconds each
@each_overlay
@pytest.mark.parametrize("version", [KUBERNETES_VERSION, NEWEST_VERSION])
def test_overlay_validates_strict(rendered, overlay, version, tmp_path):
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(rendered[overlay]))
    done = _validate(path, version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ERROR" not in done.stdout, done.stdout
    unvalidated = set(re.findall(r"Couldn't find schema for kind (\w+)", done.stdout))
    assert unvalidated <= CRD_KINDS, done.stdout
    passed = len(re.findall(r"^INFO .* passed", done.stdout, re.M))
    assert passed == sum(1 for d in rendered[overlay] if d["kind"] not in CRD_KINDS)


@pytest.mark.slow
def test_validation_catches_an_unknown_field(rendered, tmp_path):
    """The validator is strict: a field Kubernetes does not know fails (so the pass above means something)."""
    docs = copy.deepcopy(rendered["cpu"])
    engine = one(docs, "StatefulSet", "tokenmill-engine")
    pod_spec(engine)["containers"][0]["readinessProbe"]["grpcc"] = {"port": 50051}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    done = _validate(path, KUBERNETES_VERSION)
    assert done.returncode != 0 and "grpcc" in done.stdout, done.stdout


@each_overlay
def test_containers_parse_as_their_services(rendered, overlay):
    """Each container's args and env through its service's own settings parser: flags it knows,
    variables it reads, listening on every interface (the kubelet probes the pod's address) on a
    port the container declares."""
    docs = rendered[overlay]
    for workload, container in _containers(docs):
        who = f"{overlay}: {workload['metadata']['name']}/{container['name']}"
        module = service_module(container)
        env = _env(docs, container)
        try:
            config, read = parse_container(module, container.get("args", []), env)
        except SystemExit as exc:
            raise AssertionError(f"{who}: services.{module} refuses its args {container.get('args')}") from exc
        unknown = {name for name in env if name not in read and name not in PROCESS_ENV}
        assert not unknown, f"{who}: variables services.{module} does not read: {sorted(unknown)}"
        declared = {p["containerPort"] for p in container.get("ports", [])}
        assert config.host in WILDCARD_HOSTS, f"{who}: listens on {config.host}, unreachable for probes and peers"
        assert config.port in declared, f"{who}: serves on {config.port}, declares {sorted(declared)}"
        if config.metrics_port >= 0:
            assert config.metrics_port in declared, f"{who}: /metrics on {config.metrics_port} is not declared"
        # A TLS port cannot be probed by the kubelet (plaintext, no client certificate): its
        # probes ask the plaintext health-only port (components/tls).
        probed = config.health_port if config.tls_cert else config.port
        if config.health_port >= 0:
            assert config.health_port in declared, f"{who}: health port {config.health_port} is not declared"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in container:
                probe = container[kind]
                assert "grpc" in probe, f"{who}: {kind} is not a native gRPC probe"
                assert probe["grpc"]["port"] == probed, f"{who}: {kind} probes another port"


@each_overlay
def test_every_probe_names_a_served_health_service(rendered, overlay):
    names = {"scheduler": "tokenmill.v1.Generation", "executor": "tokenmill.v1.Executor",
             "tokenizer": "tokenmill.v1.Tokenizer", "drafter": "tokenmill.v1.Drafter",
             "gateway": "tokenmill.v1.Generation"}
    for workload, container in _containers(rendered[overlay]):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in container:
                service = container[kind]["grpc"].get("service", "")
                assert service in ("", names[service_module(container)]), (container["name"], kind, service)
        assert "readinessProbe" in container and "livenessProbe" in container, container["name"]


@each_overlay
def test_drain_fits_the_termination_grace(rendered, overlay):
    """The kubelet's stop of each pod fits terminationGracePeriodSeconds: the main containers'
    preStop wait and grace, then the sidecars' grace (they get SIGTERM once the main ones exited),
    and the stop itself. Every main container waits in preStop for endpoints to let go."""
    docs = rendered[overlay]
    for workload in _workloads(docs):
        spec = pod_spec(workload)

        def grace(container: dict) -> float:
            config, _ = parse_container(service_module(container), container.get("args", []), _env(docs, container))
            return config.shutdown_grace_seconds

        mains = max(prestop_seconds(c) + grace(c) for c in spec["containers"])
        after = max((grace(c) for c in sidecars(spec)), default=0.0)
        assert mains + after + DRAIN_MARGIN_S <= spec["terminationGracePeriodSeconds"], workload["metadata"]["name"]
        for container in spec["containers"]:
            assert prestop_seconds(container) > 0, f"{container['name']}: no preStop wait for endpoints to let go"


def test_engine_executor_is_a_sidecar_started_first(rendered):
    """The scheduler exits when its executor still loads at start; as a native sidecar with a
    startupProbe the executor is SERVING before the scheduler starts, and stops after it."""
    for overlay, docs in rendered.items():
        spec = pod_spec(one(docs, "StatefulSet", "tokenmill-engine"))
        assert sidecars(spec), overlay
        for executor in sidecars(spec):
            assert service_module(executor) == "executor" and "startupProbe" in executor, overlay
        assert [service_module(c) for c in spec["containers"]] == ["scheduler"], overlay


def test_engine_pod_keeps_its_executors_local(rendered):
    """One pod: the scheduler's executor addresses are its own pod's executor sidecars, each on its
    own port, in the order they are listed."""
    for overlay, docs in rendered.items():
        engine = one(docs, "StatefulSet", "tokenmill-engine")
        spec = pod_spec(engine)
        (scheduler_container,) = spec["containers"]
        scheduler, _ = parse_container("scheduler", scheduler_container["args"], _env(docs, scheduler_container))
        ports = []
        for sidecar in sidecars(spec):
            executor, _ = parse_container("executor", sidecar["args"], _env(docs, sidecar))
            ports.append(executor.port)
        assert sorted(scheduler.executor_addresses) == sorted(f"127.0.0.1:{p}" for p in ports), overlay
        assert len(set(ports)) == len(ports) == (2 if overlay == "gpu-2x" else 1), overlay
        if overlay == "cpu+auth":
            assert scheduler.auth_tokens_file == "/etc/tokenmill/auth/tokens.json"
        assert engine["spec"]["serviceName"] == "tokenmill-engine"
        assert one(docs, "Service", "tokenmill-engine")["spec"]["clusterIP"] == "None"
        assert one(docs, "Service", "tokenmill-tokenizer")["spec"]["clusterIP"] == "None"


@each_overlay
def test_port_names_are_valid_service_names(rendered, overlay):
    """A port name is an IANA service name (at most 15 characters): the API server refuses others,
    and the schemas do not say so."""
    for workload, container in _containers(rendered[overlay]):
        for port in container.get("ports", []):
            name = port.get("name", "")
            assert re.fullmatch(r"(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", name) and "--" not in name, \
                (container["name"], name)


def _selected(policy: dict, docs: list[dict]) -> list[dict]:
    labels = policy["spec"]["podSelector"].get("matchLabels", {})
    return [w for w in _workloads(docs) if labels.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


def _component(labels: dict) -> str:
    return labels.get("app.kubernetes.io/component", "*")


@each_overlay
def test_network_policies(rendered, overlay):
    """Ingress: clients may call the gateway; the gateway the schedulers; the schedulers (engine pods)
    the tokenizers and drafters; nothing may call an executor; monitoring may scrape /metrics ports;
    nothing else."""
    docs = rendered[overlay]
    allowed: dict[tuple[str, int], set[str]] = {}
    for policy in by_kind(docs, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] in (["Ingress"], ["Egress"]), policy["metadata"]["name"]
        if policy["spec"]["policyTypes"] != ["Ingress"]:
            continue
        for workload in _selected(policy, docs):
            for rule in policy["spec"].get("ingress", []):
                sources = {_component(s["podSelector"].get("matchLabels", {})) if "podSelector" in s else
                           "ns:" + s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                           for s in rule["from"]} if "from" in rule else {"anyone"}
                for port in rule["ports"]:
                    allowed.setdefault((_component(workload["metadata"]["labels"]), port["port"]), set()).update(sources)
    assert any(p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress")
               and p["spec"]["podSelector"]["matchLabels"] ==
               {"app.kubernetes.io/name": "tokenmill", "app.kubernetes.io/part-of": "tokenmill"}
               for p in by_kind(docs, "NetworkPolicy")), "no default-deny policy over every tokenmill pod"
    expected = {("engine", 50051): {"gateway"}, ("tokenizer", 50052): {"engine"}, ("drafter", 50054): {"engine"},
                ("gateway", 8000): {"anyone"}, ("gateway", 50050): {"anyone"}}
    for (component, port), sources in allowed.items():
        if sources == {"ns:monitoring"}:
            workload = next(w for w in _workloads(docs) if _component(w["metadata"]["labels"]) == component)
            names = {p.get("name") for c in all_containers(pod_spec(workload)) for p in c.get("ports", [])
                     if p["containerPort"] == port}
            assert any(n and n.endswith("metrics") for n in names), (component, port, names)
        else:
            assert expected.get((component, port)) == sources, (component, port, sources)
    assert set(expected) <= set(allowed)
    assert not any(port == 50053 for _, port in allowed), "an executor port is open to another pod"


@each_overlay
def test_egress_policies(rendered, overlay):
    """Egress: every tokenmill pod may ask the cluster DNS; the gateway may call the schedulers and
    HTTPS upstreams; the engine pods the tokenizers and drafters; nothing else (a tokenizer, a
    drafter or an executor taken over cannot call out)."""
    docs = rendered[overlay]
    allowed: dict[str, set[tuple[str, int]]] = {}
    everyone = {"app.kubernetes.io/name": "tokenmill", "app.kubernetes.io/part-of": "tokenmill"}
    for policy in by_kind(docs, "NetworkPolicy"):
        if policy["spec"]["policyTypes"] != ["Egress"]:
            continue
        who = "*" if policy["spec"]["podSelector"]["matchLabels"] == everyone else _component(
            policy["spec"]["podSelector"]["matchLabels"])
        for rule in policy["spec"].get("egress", []):
            destinations = {"ns:" + s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                            if "podSelector" not in s else _component(s["podSelector"]["matchLabels"])
                            for s in rule["to"]} if "to" in rule else {"anywhere"}
            for port in rule["ports"]:
                allowed.setdefault(who, set()).update((d, port["port"]) for d in destinations)
    assert allowed == {"*": {("ns:kube-system", 53)}, "gateway": {("engine", 50051), ("anywhere", 443)},
                       "engine": {("tokenizer", 50052), ("drafter", 50054)}}, allowed
    assert {_component(w["metadata"]["labels"]) for w in _workloads(docs)} <= {"gateway", "engine", "tokenizer",
                                                                               "drafter"}


def _dockerfile_user() -> int:
    users = re.findall(r"^USER\s+(\d+)(?::(\d+))?\s*$", DOCKERFILE.read_text(), re.M)
    assert users, "the Dockerfile sets no numeric USER"
    return int(users[-1][0])


@each_overlay
def test_pods_run_as_the_image_user(rendered, overlay):
    uid = _dockerfile_user()
    assert uid != 0
    for workload, container in _containers(rendered[overlay]):
        security = pod_spec(workload)["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == uid, workload["metadata"]["name"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        # The image's code and CPU kernel build are root-owned and read-only (test_dockerfile.py);
        # what a service writes goes to an emptyDir.
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]


def test_autoscaler_targets_the_engines(rendered):
    for overlay, docs in rendered.items():
        (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                                 "name": "tokenmill-engine"}, overlay
        (pdb,) = [p for p in by_kind(docs, "PodDisruptionBudget") if p["metadata"]["name"] == "tokenmill-engine"]
        assert pdb["spec"]["maxUnavailable"] == 1


def test_gpu_overlays_give_each_executor_a_gpu(rendered):
    for overlay in ("gpu", "gpu-2x"):
        engine = one(rendered[overlay], "StatefulSet", "tokenmill-engine")
        for executor in sidecars(pod_spec(engine)):
            assert executor["resources"]["limits"]["nvidia.com/gpu"] == "1"
            config, _ = parse_container("executor", executor["args"], _env(rendered[overlay], executor))
            assert config.executor.device == "cuda"
    cpu_engine = one(rendered["cpu"], "StatefulSet", "tokenmill-engine")
    cpu_executor = next(c for c in all_containers(pod_spec(cpu_engine)) if c["name"] == "executor")
    assert "nvidia.com/gpu" not in str(cpu_executor["resources"])
    config, _ = parse_container("executor", cpu_executor["args"], _env(rendered["cpu"], cpu_executor))
    assert config.executor.device == "cpu"


def test_a_wrong_flag_or_variable_is_caught():
    """The parse above fails on a misspelt flag, and the variables read are the service's own."""
    with pytest.raises(SystemExit):
        parse_container("scheduler", ["--executor-adress=127.0.0.1:50053"], {})
    _, read = parse_container("executor", [], {})
    assert "TOKENMILL_EXECUTOR_DEVICE" in read and "TOKENMILL_EXECUTOR_DEVIC" not in read
    with pytest.raises(ManifestError, match="runs no"):
        service_module({"name": "x", "command": ["python", "-m", "tokenmill"]})


@each_overlay
def test_pod_monitor_scrapes_every_metrics_port(rendered, overlay):
    """Prometheus (through the PodMonitor) scrapes each /metrics port the services serve, by name."""
    docs = rendered[overlay]
    (monitor,) = by_kind(docs, "PodMonitor")
    scraped = {endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]}
    served = set()
    for workload, container in _containers(docs):
        config, _ = parse_container(service_module(container), container.get("args", []), _env(docs, container))
        (name,) = [p["name"] for p in container["ports"] if p["containerPort"] == config.metrics_port]
        served.add(name)
        if service_module(container) == "gateway":  # its routing metrics: /metrics on the HTTP port
            (name,) = [p["name"] for p in container["ports"] if p["containerPort"] == config.http_port]
            served.add(name)
    assert scraped == served, (scraped, served)


@each_overlay
def test_every_internal_call_carries_the_deployment_secret(rendered, overlay):
    """The tokenizer, executors and drafter require the internal secret, and the scheduler sends
    it: each reads --internal-secret-file from the tokenmill-internal Secret, mounted read-only and
    private to the pod's group (the services refuse a file others may read). A pod's network is no
    trust boundary (any container sharing it, any local process, reaches a plaintext port)."""
    docs = rendered[overlay]
    seen = set()
    for workload, container in _containers(docs):
        module = service_module(container)
        if module not in ("tokenizer", "executor", "drafter", "scheduler"):
            continue
        who = f"{overlay}: {workload['metadata']['name']}/{container['name']}"
        config, _ = parse_container(module, container.get("args", []), _env(docs, container))
        assert config.internal_secret_file, f"{who}: no --internal-secret-file"
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        mounts = [m for m in container.get("volumeMounts", [])
                  if config.internal_secret_file.startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1 and mounts[0].get("readOnly"), f"{who}: the secret's folder is not mounted read-only"
        secret = volumes[mounts[0]["name"]].get("secret", {})
        assert secret.get("secretName") == "tokenmill-internal", f"{who}: not the tokenmill-internal Secret"
        assert secret.get("defaultMode", 0o644) & 0o027 == 0, f"{who}: the secret's file would be open to others"
        seen.add(module)
    assert seen == {"tokenizer", "executor", "drafter", "scheduler"}, seen
