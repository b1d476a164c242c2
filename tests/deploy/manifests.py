"""The rendered Kubernetes manifests, read as the cluster would run them, and run as local processes.

``render(overlay)`` is ``kubectl kustomize``. ``LocalCluster`` takes the rendered objects and
gives each workload's pod (one replica; a StatefulSet's is ``NAME-0``) what a cluster would:
every containerPort a free port on 127.0.0.1 (one namespace here, so pods cannot share numbers),
cluster DNS names (a Service, a StatefulSet pod under its headless Service; short, namespaced or
fully qualified) resolved to 127.0.0.1 and the chosen port of the pod the Service selects (the
StatefulSet pods beyond the first, up to its autoscaler's maxReplicas, to a port where nothing
listens: replicas not started, whose names a routes file may list),
``localhost`` to the pod's own ports, the image's directory to this checkout, volumes to temporary
folders filled from the rendered ConfigMaps and Secrets (or from ``secrets`` for the ones a user
creates). Everything else comes from the manifest unchanged: command, args, env, envFrom. A name
the manifest uses that nothing declares (a port no container lists, a host no Service answers
for) raises ``ManifestError`` naming it, as the cluster would fail it.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_ROOT = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "gpu-2x")
COMPOSED = {"cpu+auth": ("cpu", ("auth",)), "cpu+auth+tls": ("cpu", ("auth", "tls")), "gpu+tls": ("gpu", ("tls",))}
"""Overlays with opt-in components added, as a user's kustomization would: (overlay, components)."""
VARIANTS = (*OVERLAYS, *COMPOSED)
IMAGE_ROOT = "/opt/tokenmill"
"""Where the Dockerfile puts the checkout (its WORKDIR); test_dockerfile.py checks the two agree."""
CLUSTER_DOMAIN = "cluster.local"
LOCALHOSTS = ("127.0.0.1", "localhost")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")

_ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9.-]*):(\d{2,5})(?!\d)")
_PORT_FLAG = re.compile(r"^(--[a-z-]*port)=(\d+)$")


class ManifestError(AssertionError):
    """The manifest names something the cluster would not find."""


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise ManifestError(
            "kubectl is not on PATH: the deploy tests render deploy/kubernetes with `kubectl kustomize` "
            "(kubectl 1.27 or newer; its kustomize is built in). Install it, e.g. Debian's or Kubernetes' "
            "apt package `kubectl`, and run the tests again")
    return path


def render(overlay: str | Path) -> list[dict]:
    """``kubectl kustomize`` of an overlay (a name under overlays/, or a directory)."""
    path = Path(overlay) if isinstance(overlay, Path) else KUSTOMIZE_ROOT / "overlays" / overlay
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ManifestError(f"kubectl kustomize {path} failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_variant(name: str, workdir: Path) -> list[dict]:
    """An overlay, or one of COMPOSED: a kustomization written in ``workdir`` that takes the
    overlay and adds the components."""
    if name not in COMPOSED:
        return render(name)
    overlay, components = COMPOSED[name]
    folder = workdir / name.replace("+", "-")
    folder.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(KUSTOMIZE_ROOT, folder)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{rel}/overlays/{overlay}"], "components": [f"{rel}/components/{c}" for c in components]}))
    return render(folder)


def by_kind(docs: Iterable[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: Iterable[dict], kind: str, name: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name]
    if len(found) != 1:
        raise ManifestError(f"expected one {kind} named {name}, found {len(found)}")
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def sidecars(spec: dict) -> list[dict]:
    """Native sidecars: init containers that keep running (restartPolicy Always). The kubelet starts
    them first, each one's startupProbe passing before the next container starts, and stops them
    after the main containers have exited."""
    init = spec.get("initContainers", [])
    plain = [c["name"] for c in init if c.get("restartPolicy") != "Always"]
    if plain:
        raise ManifestError(f"init containers that run to completion are not modelled here: {plain}")
    return list(init)


def all_containers(spec: dict) -> list[dict]:
    """Sidecars, then the main containers: every process of the pod."""
    return [*sidecars(spec), *spec["containers"]]


def service_module(container: dict) -> str:
    """The tokenmill service a container runs (``python -m services.NAME``)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    for i, item in enumerate(argv[:-1]):
        if item == "-m" and argv[i + 1].startswith("services."):
            return argv[i + 1].split(".")[1]
    raise ManifestError(f"container {container['name']} runs no `python -m services.NAME`: {argv}")


def prestop_seconds(container: dict) -> float:
    """How long the container's preStop hook holds SIGTERM back (its sleep action)."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" not in hook:
        raise ManifestError(f"container {container['name']}: preStop is not a sleep action: {hook}")
    return float(hook["sleep"]["seconds"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LocalPod:
    name: str
    workload: dict
    labels: dict[str, str]
    ports: dict[int, int] = field(default_factory=dict)
    """containerPort -> the local port standing in for it."""
    named_ports: dict[str, int] = field(default_factory=dict)
    """port name -> containerPort."""
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    """container name -> its running process."""

    @property
    def spec(self) -> dict:
        return pod_spec(self.workload)

    @property
    def containers(self) -> list[dict]:
        """Every container of the pod, sidecars first."""
        return all_containers(self.spec)

    @property
    def sidecar_names(self) -> list[str]:
        return [c["name"] for c in sidecars(self.spec)]

    def container(self, name: str) -> dict:
        for container in self.containers:
            if container["name"] == name:
                return container
        raise ManifestError(f"pod {self.name} has no container {name}")

    def local_port(self, port: int | str, who: str) -> int:
        number = self.named_ports.get(port) if isinstance(port, str) else port
        if number is None or number not in self.ports:
            raise ManifestError(f"{who} names port {port} of pod {self.name}, which none of its containers declares "
                                f"(declared: {sorted(self.ports)})")
        return self.ports[number]


@dataclass
class LocalContainer:
    """One container as a local command line."""

    pod: LocalPod
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path


class LocalCluster:
    def __init__(self, docs: list[dict], workdir: Path, *, secrets: Mapping[str, Mapping[str, str]] = (),
                 extra_env: Mapping[str, str] | None = None) -> None:
        self.docs = docs
        self.workdir = workdir
        self.secrets = {name: dict(data) for name, data in dict(secrets).items()}
        self.extra_env = dict(extra_env or {})
        """Set on every process after the manifest's env (OMP_NUM_THREADS on a small test machine)."""
        namespaces = {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"}
        if len(namespaces) != 1:
            raise ManifestError(f"expected every object in one namespace, found {namespaces}")
        self.namespace = namespaces.pop() or "default"
        self.pods: dict[str, LocalPod] = {}
        for workload in docs:
            if workload["kind"] not in WORKLOAD_KINDS:
                continue
            name = workload["metadata"]["name"] + ("-0" if workload["kind"] == "StatefulSet" else "")
            pod = LocalPod(name, workload, dict(workload["spec"]["template"]["metadata"].get("labels", {})))
            for container in pod.containers:
                for port in container.get("ports", []):
                    number = port["containerPort"]
                    if number in pod.ports:
                        raise ManifestError(f"pod {name}: containerPort {number} is declared twice")
                    pod.ports[number] = free_port()
                    if "name" in port:
                        pod.named_ports[port["name"]] = number
            self.pods[name] = pod
        self._absent = socket.socket()
        self._absent.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        self._hosts = self._cluster_dns()
        self._log_dir = workdir / "logs"

    # ------------------------------------------------------------------ names
    def _dns_forms(self, name: str) -> list[str]:
        ns = self.namespace
        return [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.{CLUSTER_DOMAIN}"]

    def _replicas(self, workload: dict) -> int:
        """The most pods a workload may have: its autoscaler's maxReplicas, else its replicas."""
        for hpa in by_kind(self.docs, "HorizontalPodAutoscaler"):
            ref = hpa["spec"]["scaleTargetRef"]
            if (ref["kind"], ref["name"]) == (workload["kind"], workload["metadata"]["name"]):
                return int(hpa["spec"]["maxReplicas"])
        return int(workload["spec"].get("replicas", 1))

    def _cluster_dns(self) -> dict[str, tuple[LocalPod | None, dict | None]]:
        """host -> (the pod it reaches, None for a replica not started; the Service whose ports map
        it, None: the pod's own ports)."""
        hosts: dict[str, tuple[LocalPod | None, dict | None]] = {}
        for service in by_kind(self.docs, "Service"):
            selector = service["spec"].get("selector", {})
            selected = [pod for pod in self.pods.values() if selector and selector.items() <= pod.labels.items()]
            if not selected:
                continue  # a Service for pods this run does not start
            for form in self._dns_forms(service["metadata"]["name"]):
                hosts[form] = (selected[0], service)
            if service["spec"].get("clusterIP") == "None":
                for pod in selected:
                    if pod.workload["kind"] == "StatefulSet" and \
                            pod.workload["spec"].get("serviceName") == service["metadata"]["name"]:
                        for form in self._dns_forms(f"{pod.name}.{service['metadata']['name']}"):
                            hosts[form] = (pod, None)
                        base = pod.workload["metadata"]["name"]
                        for index in range(1, self._replicas(pod.workload)):
                            for form in self._dns_forms(f"{base}-{index}.{service['metadata']['name']}"):
                                hosts[form] = (None, None)
        return hosts

    def resolve(self, host: str, port: int, pod: LocalPod, who: str) -> int:
        """The local port that host:port reaches from ``pod``."""
        if host in LOCALHOSTS:
            return pod.local_port(port, who)
        if host not in self._hosts:
            raise ManifestError(f"{who} names host {host}, which no Service of the manifests answers for "
                                f"(known: {sorted(h for h in self._hosts if '.' not in h)})")
        target, service = self._hosts[host]
        if target is None:
            return self._absent.getsockname()[1]
        if service is None:
            return target.local_port(port, who)
        for entry in service["spec"]["ports"]:
            if entry["port"] == port:
                return target.local_port(entry.get("targetPort", port), f"{who} (Service {service['metadata']['name']})")
        raise ManifestError(f"{who} names {host}:{port}, but Service {service['metadata']['name']} has no port {port}")

    def rewrite(self, text: str, pod: LocalPod, who: str, mounts: Mapping[str, Path]) -> str:
        """A manifest string as the local process needs it: addresses and paths mapped."""
        text = self._rewrite_path_tokens(text, mounts)

        def address(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in WILDCARD_HOSTS:
                return f"127.0.0.1:{pod.local_port(port, who)}"
            return f"127.0.0.1:{self.resolve(host, port, pod, who)}"

        return _ADDRESS.sub(address, text)

    @staticmethod
    def _rewrite_path(text: str, mounts: Mapping[str, Path]) -> str:
        for prefix in sorted(mounts, key=len, reverse=True):
            if text == prefix or text.startswith(prefix.rstrip("/") + "/"):
                return str(mounts[prefix]) + text[len(prefix.rstrip("/")):]
        return text

    # ------------------------------------------------------------------ data
    def _config_map(self, name: str) -> dict[str, str]:
        return dict(one(self.docs, "ConfigMap", name).get("data", {}))

    def _has_secret(self, name: str) -> bool:
        return name in self.secrets or any(doc["metadata"]["name"] == name for doc in by_kind(self.docs, "Secret"))

    def _secret(self, name: str) -> dict[str, str]:
        found = [doc for doc in by_kind(self.docs, "Secret") if doc["metadata"]["name"] == name]
        if found:
            data = {k: base64.b64decode(v).decode() for k, v in found[0].get("data", {}).items()}
            return {**data, **found[0].get("stringData", {})}
        if name not in self.secrets:
            raise ManifestError(f"Secret {name} is neither rendered nor given to the test")
        return self.secrets[name]

    def _mounts(self, pod: LocalPod, container: dict) -> dict[str, Path]:
        """mountPath -> a local folder holding what the volume holds."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        mounts: dict[str, Path] = {IMAGE_ROOT: REPO_ROOT}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"])
            if volume is None:
                raise ManifestError(f"{pod.name}/{container['name']} mounts volume {mount['name']}, which the pod lacks")
            folder = self.workdir / pod.name / "volumes" / mount["name"]
            if not folder.exists():
                folder.mkdir(parents=True)
                if "configMap" in volume:
                    self._fill(folder, self._config_map(volume["configMap"]["name"]), pod, volume)
                elif "secret" in volume:
                    name = volume["secret"]["secretName"]
                    if not (volume["secret"].get("optional") and not self._has_secret(name)):
                        self._fill(folder, self._secret(name), pod, volume)  # an optional one absent: empty
                elif "emptyDir" in volume:
                    pass
                elif "persistentVolumeClaim" in volume:
                    raise ManifestError(f"{pod.name} mounts claim {volume['persistentVolumeClaim']['claimName']}: "
                                        "a volume this local run cannot stand in for")
                else:
                    raise ManifestError(f"{pod.name}: volume {mount['name']} of an unsupported kind: {volume}")
            source = folder / mount["subPath"] if "subPath" in mount else folder
            mounts[mount["mountPath"]] = source
        return mounts

    def _fill(self, folder: Path, data: Mapping[str, str], pod: LocalPod, volume: dict) -> None:
        source = volume.get("configMap") or volume.get("secret") or {}
        items = source.get("items")
        files = {item["path"]: data[item["key"]] for item in items} if items else dict(data)
        for path, content in files.items():
            target = folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            # The kubelet's file mode (0644 unless the volume says; the scheduler refuses a tokens
            # file others may read).
            target.chmod(source.get("defaultMode", 0o644))

    def _rewrite_files(self, pod: LocalPod, mounts: Mapping[str, Path]) -> None:
        """Configuration files mounted from ConfigMaps name cluster addresses and image paths too."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for container in pod.containers:
            for mount in container.get("volumeMounts", []):
                if "configMap" not in volumes[mount["name"]]:
                    continue
                for path in (self.workdir / pod.name / "volumes" / mount["name"]).rglob("*"):
                    if path.is_file():
                        who = f"{pod.name} file {mount['mountPath']}/{path.name}"
                        lines = path.read_text().splitlines()
                        path.write_text("\n".join(self.rewrite(line, pod, who, mounts) for line in lines) + "\n")

    def _rewrite_path_tokens(self, text: str, mounts: Mapping[str, Path]) -> str:
        """Every absolute path in ``text`` under a mount (or the image's folder) mapped to its local folder."""
        return re.sub(r"(?<![\w.:/])(/[\w./-]+)", lambda m: self._rewrite_path(m.group(1), mounts), text)

    # ------------------------------------------------------------------ commands
    def env_of(self, pod: LocalPod, container: dict) -> dict[str, str]:
        """The container's environment as the manifest gives it (envFrom, then env)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                env.update(self._config_map(source["configMapRef"]["name"]))
            elif "secretRef" in source:
                env.update(self._secret(source["secretRef"]["name"]))
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif "configMapKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["configMapKeyRef"]
                env[item["name"]] = self._config_map(ref["name"])[ref["key"]]
            elif "secretKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = self._secret(ref["name"])[ref["key"]]
            else:
                raise ManifestError(f"{pod.name}/{container['name']}: env {item['name']} of an unsupported form")
        return env

    def local_container(self, pod: LocalPod, container: dict) -> LocalContainer:
        who = f"{pod.name}/{container['name']}"
        mounts = self._mounts(pod, container)
        argv = [self._map_port_flag(self.rewrite(a, pod, who, mounts), pod, who)
                for a in [*container["command"], *container.get("args", [])]]
        argv = _map_split_port_flags(argv, pod, who)
        env = {}
        for name, value in self.env_of(pod, container).items():
            value = self.rewrite(value, pod, f"{who} env {name}", mounts)
            if name.endswith("_PORT") and value.isdigit() and int(value) > 0:
                value = str(pod.local_port(int(value), f"{who} env {name}"))
            if name.endswith("_HOST") and value in WILDCARD_HOSTS:
                value = "127.0.0.1"
            env[name] = value
        argv = [_local_host_flag(a) for a in argv]
        return LocalContainer(pod, container["name"], argv, env, REPO_ROOT)

    @staticmethod
    def _map_port_flag(arg: str, pod: LocalPod, who: str) -> str:
        match = _PORT_FLAG.match(arg)
        if match is None or int(match.group(2)) <= 0:
            return arg
        return f"{match.group(1)}={pod.local_port(int(match.group(2)), f'{who} {match.group(1)}')}"

    # ------------------------------------------------------------------ processes
    def start(self, pod_names: Iterable[str] | None = None, log_dir: Path | None = None,
              startup_timeout_s: float = 240.0) -> None:
        """Start the pods (all of them by default) as the kubelet does: every pod at once; in a pod
        the sidecars first, the main containers once each sidecar's startupProbe reports SERVING."""
        names = list(pod_names) if pod_names is not None else list(self.pods)
        self._log_dir = log_dir or self.workdir / "logs"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(names, startup_timeout_s)
        except BaseException:
            self.stop()  # a pod that failed to start leaves none of the others running
            raise

    def _start(self, names: list[str], startup_timeout_s: float) -> None:
        for name in names:
            pod = self.pods[name]
            self._rewrite_files(pod, self._mounts(pod, pod.containers[0]))
            for container in sidecars(pod.spec) or pod.spec["containers"]:
                self._spawn(pod, container)
        for name in names:
            pod = self.pods[name]
            for container in sidecars(pod.spec):
                if "startupProbe" in container:
                    self.wait_probe(pod, container["name"], container["startupProbe"], startup_timeout_s)
            if pod.sidecar_names:
                for container in pod.spec["containers"]:
                    self._spawn(pod, container)

    def _spawn(self, pod: LocalPod, container: dict) -> None:
        local = self.local_container(pod, container)
        base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env = {**base, **local.env, **self.extra_env}
        with open(self._log_dir / f"{pod.name}.{container['name']}.log", "ab") as log:
            pod.processes[container["name"]] = subprocess.Popen(
                local.argv, env=env, cwd=local.cwd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    def wait_probe(self, pod: LocalPod, container: str, probe: dict, timeout_s: float) -> None:
        """Until the gRPC probe reports SERVING (what the kubelet's probe accepts); fails with the
        container's log when a process of the pod exits or the time runs out."""
        from services.stack.launcher import health_status

        address = f"127.0.0.1:{pod.local_port(probe['grpc']['port'], f'{pod.name}/{container} probe')}"
        deadline = time.monotonic() + timeout_s
        status = ""
        while time.monotonic() < deadline:
            for name, process in pod.processes.items():
                if process.poll() is not None:
                    raise ManifestError(f"{pod.name}/{name} exited with {process.returncode} while starting:\n"
                                        f"{self.log(pod.name, name)[-3000:]}")
            status = health_status(address, probe["grpc"].get("service", ""), timeout=2.0)
            if status == "SERVING":
                return
            time.sleep(0.25)
        raise ManifestError(f"{pod.name}/{container}: probe still {status} after {timeout_s:.0f}s:\n"
                            f"{self.log(pod.name, container)[-3000:]}")

    def log(self, pod: str, container: str) -> str:
        path = self._log_dir / f"{pod}.{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_pod(self, pod_name: str, grace_s: float, on_signal: Callable[[float], None] = lambda t: None
                 ) -> dict[str, tuple[int | None, float]]:
        """The kubelet's stop of one pod (after preStop, which is a wait): SIGTERM to every main
        container at once, then, once they all exited, to the sidecars; SIGKILL to whatever still
        runs ``grace_s`` after the first SIGTERM. Returns {container: (exit status, seconds after
        the first SIGTERM)}; ``on_signal`` gets the monotonic time of that SIGTERM."""
        pod = self.pods[pod_name]
        sent = time.monotonic()
        on_signal(sent)
        deadline = sent + grace_s
        exits: dict[str, tuple[int | None, float]] = {}
        mains = [c["name"] for c in pod.spec["containers"]]
        for group in (mains, pod.sidecar_names):
            for name in group:
                pod.processes[name].send_signal(signal.SIGTERM)
            for name in group:
                process = pod.processes[name]
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                    exits[name] = (None, round(time.monotonic() - sent, 2))
                    continue
                exits[name] = (process.returncode, round(time.monotonic() - sent, 2))
        return exits

    def stop(self) -> None:
        self._absent.close()
        for pod in self.pods.values():
            for process in pod.processes.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for pod in self.pods.values():
            for process in pod.processes.values():
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _local_host_flag(arg: str) -> str:
    """--host=0.0.0.0 (what a pod needs for its probes) becomes loopback here."""
    name, _, value = arg.partition("=")
    if name == "--host" and value in WILDCARD_HOSTS:
        return "--host=127.0.0.1"
    return arg


def _map_split_port_flags(argv: list[str], pod: LocalPod, who: str) -> list[str]:
    """``--port 50051`` written as two items maps like ``--port=50051``."""
    out = list(argv)
    for i in range(len(out) - 1):
        if re.fullmatch(r"--[a-z-]*port", out[i]) and out[i + 1].isdigit() and int(out[i + 1]) > 0:
            out[i + 1] = str(pod.local_port(int(out[i + 1]), f"{who} {out[i]}"))
        elif out[i] == "--host" and out[i + 1] in WILDCARD_HOSTS:
            out[i + 1] = "127.0.0.1"
    return out


def probe_targets(pod: LocalPod) -> list[tuple[str, str, dict]]:
    """(container, probe kind, probe) for every probe the pod's containers declare."""
    return [(c["name"], kind, c[kind]) for c in pod.containers for kind in PROBES if kind in c]


def container_config(module: str):
    """The settings dataclass a service's process parses its flags and environment into."""
    if module == "scheduler":
        from services.scheduler.config import SchedulerServiceConfig as config
    elif module == "executor":
        from services.executor.config import ExecutorServiceConfig as config
    elif module == "tokenizer":
        from services.tokenizer.config import TokenizerConfig as config
    elif module == "drafter":
        from services.drafter.config import DrafterConfig as config
    elif module == "gateway":
        from services.gateway.config import GatewayServiceConfig as config
    else:
        raise ManifestError(f"no tokenmill service named {module}")
    return config


class _RecordingEnv(dict):
    """An environment that remembers every variable looked up in it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.asked: set[str] = set()

    def __contains__(self, key: object) -> bool:
        self.asked.add(str(key))
        return super().__contains__(key)

    def get(self, key, default=None):  # noqa: ANN001 - dict's signature
        self.asked.add(str(key))
        return super().get(key, default)


def parse_container(module: str, args: list[str], env: Mapping[str, str]) -> tuple[Any, set[str]]:
    """The service's own parse of a container's args and env: (its config, the variables it reads).
    A flag it does not know ends the parse with SystemExit (status 2), as in the pod."""
    from services.common.settings import parse_config

    recording = _RecordingEnv(env)
    config = parse_config(container_config(module), list(args), env=recording, prog=f"services.{module}")
    return config, recording.asked
