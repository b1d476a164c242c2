"""The manifests are the truth: the cpu overlay with bearer tokens (components/auth), rendered,
run as local processes.

Each container's command, args and env come from the rendered YAML (tests/deploy/manifests.py maps
only what a cluster would provide: ports, DNS names, volumes, the image's folder). Every probe the
manifests declare reaches SERVING; a request streams end to end through the engine's DNS name as a
gateway reaches it (tokenizer and drafter found through their Services), and through the gateway
itself (its routes file from its ConfigMap) with the official ``openai`` client and over gRPC; the
autoscaler's metrics and the alerts' series are on the running engine's /metrics. Drains: the
gateway pod, sent SIGTERM with 16 HTTP streams in flight, finishes every one, refuses new HTTP
connections and gRPC calls, and exits within its grace; then the engine pod, sent SIGTERM in both
containers at once with 16 streams in flight, finishes every stream, refuses new calls with
UNAVAILABLE, and both processes exit within the grace the manifest gives them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import re
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc
import openai
import pytest
import pytest_asyncio
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.metrics import parse_samples
from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import create_channel
from tests.deploy.manifests import (
    KUSTOMIZE_ROOT, LocalCluster, ManifestError, by_kind, pod_spec, prestop_seconds, probe_targets, render,
    render_variant,
)
from tests.helpers.stack_streams import greedy_request, record_stream

# slow: starts the cpu overlay's pods (engine, tokenizer, drafter) as processes
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

START_TIMEOUT_S = 240.0
"""Every probe SERVING within this long (the processes start together, as in a pod; loaded CPU)."""
ENGINE = "tokenmill-engine-0"
ENGINE_ADDRESS = "tokenmill-engine-0.tokenmill-engine:50051"
"""How the gateway's routes file reaches replica 0 (the StatefulSet's pod under its headless Service)."""
PROMPT = "Once upon a time, there was a little girl. The little girl"
TOKEN = "deploy-test-token"
INTERNAL_SECRET = secrets.token_hex(32)
"""The tokenmill-internal Secret a user creates (base: every internal service requires it)."""
"""The tenant's token in the tokenmill-auth Secret a user creates (components/auth)."""
DRAIN_STREAMS = 16
DRAIN_MAX_TOKENS = 448
DRAIN_READ_PAUSE_S = 0.005
"""The gateway drain's slow reader: ~2 s or more to read a stream."""
GATEWAY = "tokenmill-gateway"
MODEL = "tokenmill"
"""The model id of the gateway's routes file (base/gateway-routes.yaml)."""


def _local_cluster(workdir) -> LocalCluster:
    docs = render_variant("cpu+auth", workdir)
    secrets = {"tokenmill-auth": {"tokens.json": json.dumps([{"token": TOKEN, "tenant": "deploy-test"}])},
               "tokenmill-internal": {"secret": INTERNAL_SECRET}}
    # One OpenMP thread a process (the manifest asks for 4 cores; this machine has 2 in all).
    return LocalCluster(docs, workdir, secrets=secrets, extra_env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> LocalCluster:
    local = _local_cluster(tmp_path_factory.mktemp("cluster"))
    local.start(startup_timeout_s=START_TIMEOUT_S)
    yield local
    local.stop()


async def _health(address: str, service: str) -> str:
    async with create_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.aio.AioRpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def serving(cluster: LocalCluster) -> LocalCluster:
    for pod in cluster.pods.values():
        for container, kind, probe in probe_targets(pod):
            await asyncio.to_thread(cluster.wait_probe, pod, container, probe, START_TIMEOUT_S)
    return cluster


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(serving: LocalCluster) -> AsyncIterator[generation_pb2_grpc.GenerationStub]:
    host, port = ENGINE_ADDRESS.rsplit(":", 1)
    port = serving.resolve(host, int(port), serving.pods[ENGINE], "test client")
    async with create_channel(f"127.0.0.1:{port}") as channel:
        yield _Tenant(generation_pb2_grpc.GenerationStub(channel), TOKEN)


class _Tenant:
    """A Generation stub whose calls carry a bearer token."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, token: str) -> None:
        self.stub, self.metadata = stub, (("authorization", f"Bearer {token}"),)

    def Generate(self, request, **kwargs):  # noqa: N802 - the stub's method name
        return self.stub.Generate(request, metadata=self.metadata, **kwargs)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return parse_samples(reply.read().decode())


def _metrics_port(cluster: LocalCluster, pod: str, name: str = "metrics") -> int:
    return cluster.pods[pod].local_port(name, f"{pod} PodMonitor port {name}")


async def test_every_declared_probe_is_serving(serving: LocalCluster):
    probes = {(pod.name, c, kind) for pod in serving.pods.values() for c, kind, _ in probe_targets(pod)}
    assert {(ENGINE, "scheduler", "readinessProbe"), (ENGINE, "executor", "startupProbe"),
            ("tokenmill-tokenizer", "tokenizer", "livenessProbe"), (GATEWAY, "gateway", "readinessProbe"),
            ("tokenmill-drafter", "drafter", "readinessProbe")} <= probes
    for pod in serving.pods.values():
        for container, kind, probe in probe_targets(pod):
            address = f"127.0.0.1:{pod.local_port(probe['grpc']['port'], container)}"
            assert await _health(address, probe["grpc"].get("service", "")) == "SERVING", (pod.name, container, kind)


def _gateway_client(cluster: LocalCluster, token: str = TOKEN) -> openai.AsyncOpenAI:
    port = cluster.pods[GATEWAY].local_port("http", "test client")
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0, timeout=120)


async def _gateway_ready(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    """Until the gateway's /health is 200: its first polls of the engine found it SERVING (an
    engine that came up after the gateway is in its pool within a poll or a reconnect, ~1 s)."""
    url = f"http://127.0.0.1:{cluster.pods[GATEWAY].local_port('http', 'test client')}/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError as exc:  # 503 (HTTPError) while no engine is in the pool
            assert time.monotonic() < deadline, f"the gateway routes to no engine after {timeout_s:.0f}s: {exc}"
        await asyncio.sleep(0.1)


async def _gateway_stream(client: openai.AsyncOpenAI, max_tokens: int,
                          pause_s: float = 0.0) -> tuple[str, list[str], int, float]:
    """One streamed completion through the gateway: (text, finish reasons, completion tokens, when
    it ended); ``pause_s`` after each chunk makes a slow reader, whose stream the gateway holds open."""
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    text, reasons, tokens = [], [], 0
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if pause_s:
            await asyncio.sleep(pause_s)
    return "".join(text), reasons, tokens, time.monotonic()


async def test_a_request_streams_through_the_gateway(serving: LocalCluster, engine):
    """The gateway's Deployment as written (flags, the routes file from its ConfigMap naming the
    engine replicas by their DNS names) in front of the engine: the same greedy text over HTTP
    with the openai client as from the engine directly, over gRPC too, and the client's bearer
    token is what the engine checks."""
    await _gateway_ready(serving)
    direct = await record_stream(engine, greedy_request(PROMPT, 24))
    assert direct.finish_reason == "length", (direct.code, direct.details)
    async with _gateway_client(serving) as client:
        text, reasons, tokens, _ = await _gateway_stream(client, 24)
        assert (text, reasons, tokens) == (direct.text, ["length"], 24)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    async with _gateway_client(serving, "not-a-token") as stranger:
        with pytest.raises(openai.AuthenticationError):
            await _gateway_stream(stranger, 4)
    port = serving.pods[GATEWAY].local_port("grpc", "test client")
    async with create_channel(f"127.0.0.1:{port}") as channel:
        routed = await record_stream(_Tenant(generation_pb2_grpc.GenerationStub(channel), TOKEN),
                                     greedy_request(PROMPT, 24))
    assert routed.finish_reason == "length" and routed.text == direct.text, (routed.code, routed.details)
    # The gateway's own metrics, where the PodMonitor scrapes them (/metrics on the HTTP port).
    scraped = _scrape(serving.pods[GATEWAY].local_port("http", "PodMonitor port http"))
    assert scraped.get('tokenmill:gateway_target_healthy{target="engine-0"}') == 1.0, sorted(scraped)[:20]
    assert scraped.get('tokenmill:gateway_target_healthy{target="engine-1"}') == 0.0  # a replica not started


async def test_the_tokens_secret_is_what_the_scheduler_checks(serving: LocalCluster, engine):
    anonymous = await record_stream(engine.stub, greedy_request(PROMPT, 4), timeout=10)
    assert anonymous.code == grpc.StatusCode.UNAUTHENTICATED, (anonymous.code, anonymous.details)
    stranger = await record_stream(_Tenant(engine.stub, "not-a-token"), greedy_request(PROMPT, 4), timeout=10)
    assert stranger.code == grpc.StatusCode.UNAUTHENTICATED


async def test_a_request_streams_end_to_end(serving: LocalCluster, engine):
    record = await record_stream(engine, greedy_request(PROMPT, 48))
    assert record.finish_reason == "length", (record.code, record.details, record.kinds())
    assert len(record.token_ids) == 48 and record.text.strip()
    scheduler = _scrape(_metrics_port(serving, ENGINE))
    assert scheduler.get("tokenmill:scheduler_steps_total", 0) > 0
    # The prompt was encoded by the tokenizer behind its headless Service. (The drafter's Propose
    # stream, open while the scheduler runs, is counted once it ends: test_sigterm_drains_the_engine_pod.)
    tokenizer = _scrape(_metrics_port(serving, "tokenmill-tokenizer"))
    assert _rpc_count(tokenizer, "Encode") >= 1, sorted(tokenizer)


def _rpc_count(samples: dict[str, float], method: str) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("tokenmill:rpc_latency_seconds_count") and f'method="{method}"' in k)


def _adapter_rules() -> list[dict]:
    values = yaml.safe_load((KUSTOMIZE_ROOT / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    return values["rules"]["custom"]


def _adapter_names(rules: list[dict], series: set[str]) -> set[str]:
    """The custom-metric names the adapter publishes for these Prometheus series names."""
    published = set()
    for rule in rules:
        wanted = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
        for name in series:
            if re.fullmatch(wanted.strip("^$"), name) and re.match(rule["name"]["matches"], name):
                published.add(re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), name))
    return published


async def test_autoscaler_metrics_exist_on_the_running_engine(serving: LocalCluster, engine):
    scraped = _scrape(_metrics_port(serving, ENGINE))
    series = {key.split("{")[0] for key in scraped}
    for name in ("tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc"):
        assert name in series, sorted(series)
    published = _adapter_names(_adapter_rules(), series | {"DCGM_FI_DEV_GPU_UTIL"})
    for overlay in ("cpu", "gpu"):
        (hpa,) = by_kind(render(overlay), "HorizontalPodAutoscaler")
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert names <= published, (overlay, names - published, published)
        assert {"tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_perc"} <= names


async def test_alert_rules_name_series_the_engine_exports(serving: LocalCluster, engine):
    series = {key.split("{")[0] for key in _scrape(_metrics_port(serving, ENGINE))}
    series |= {key.split("{")[0] for key in _scrape(_metrics_port(serving, ENGINE, "exec-metrics"))}
    for overlay in ("cpu", "gpu"):
        for rule_set in by_kind(render(overlay), "PrometheusRule"):
            for group in rule_set["spec"]["groups"]:
                recorded = {r["record"] for r in group["rules"] if "record" in r}
                for rule in group["rules"]:
                    for name in re.findall(r"\b(tokenmill:[a-z_:0-9]+|DCGM_[A-Z_]+)", rule["expr"]):
                        assert name in series | recorded | {"DCGM_FI_DEV_GPU_UTIL"}, (overlay, rule.get("alert"), name)


def _engine_load(cluster: LocalCluster) -> float:
    """Requests running or waiting on the engine now."""
    scraped = _scrape(_metrics_port(cluster, ENGINE))
    return scraped.get("tokenmill:num_requests_running", 0) + scraped.get("tokenmill:num_requests_waiting", 0)


async def test_sigterm_drains_the_gateway_pod(serving: LocalCluster, engine):
    """The kubelet's stop of a gateway pod (after its preStop wait): 16 HTTP streams in flight
    finish whole; health turns NOT_SERVING; new HTTP connections are refused and new gRPC calls
    get UNAVAILABLE (a client's retry reaches another replica); the process exits 0 within the
    pod's termination grace. (Before the engine's drain, which ends what the gateway routes to.)"""
    await _gateway_ready(serving)  # its pool has seen the engine (also when this test runs alone)
    pod = serving.pods[GATEWAY]
    spec = pod_spec(pod.workload)
    preStop = max(prestop_seconds(c) for c in spec["containers"])
    async with _gateway_client(serving) as client:
        # Slow readers: the engine may finish generating before SIGTERM, the gateway still holds
        # every stream (what its drain must finish) until its client has read it.
        streams = [asyncio.ensure_future(_gateway_stream(client, DRAIN_MAX_TOKENS, pause_s=DRAIN_READ_PAUSE_S))
                   for _ in range(DRAIN_STREAMS)]
        # In flight on the gateway: every one admitted by the engine (which streams faster than
        # this client reads, so the client's first tokens would come too late to say so).
        deadline = time.monotonic() + 60
        while _engine_load(serving) < DRAIN_STREAMS:
            assert time.monotonic() < deadline, "the 16 streams never all reached the engine"
            await asyncio.sleep(0.01)
        signalled: list[float] = []
        stopping = asyncio.ensure_future(asyncio.to_thread(
            serving.stop_pod, GATEWAY, spec["terminationGracePeriodSeconds"] - preStop, signalled.append))
        while not signalled:
            await asyncio.sleep(0.001)
        # Still open at SIGTERM: the gateway had every one of these streams to forward when its
        # drain began.
        assert not any(stream.done() for stream in streams), "a stream ended before SIGTERM: raise DRAIN_READ_PAUSE_S"
        running = _engine_load(serving)
        grpc_address = f"127.0.0.1:{pod.local_port('grpc', 'test client')}"
        deadline = time.monotonic() + 10
        while not signalled or await _health(grpc_address, "tokenmill.v1.Generation") not in ("NOT_SERVING",
                                                                                               "UNAVAILABLE"):
            assert time.monotonic() < deadline, "health never left SERVING after SIGTERM"
            await asyncio.sleep(0.05)
        async with _gateway_client(serving) as late:
            with pytest.raises(openai.APIConnectionError):
                await _gateway_stream(late, 4)
        async with create_channel(grpc_address) as channel:
            refused = await record_stream(_Tenant(generation_pb2_grpc.GenerationStub(channel), TOKEN),
                                          greedy_request(PROMPT, 4), timeout=10)
        assert refused.code == grpc.StatusCode.UNAVAILABLE and not refused.messages, (refused.code, refused.details)
        results = await asyncio.gather(*streams)
    for text, reasons, tokens, _ in results:
        assert reasons == ["length"] and tokens == DRAIN_MAX_TOKENS and text, (reasons, tokens)
    assert all(r[3] > signalled[0] for r in results)  # and read to its end after it
    exits = await stopping
    assert exits["gateway"][0] == 0, (exits, serving.log(GATEWAY, "gateway")[-2000:])
    assert preStop + exits["gateway"][1] <= spec["terminationGracePeriodSeconds"], exits
    last_stream = max(r[3] for r in results) - signalled[0]
    print(f"gateway drain: {DRAIN_STREAMS} HTTP streams in flight at SIGTERM ({running:.0f} still generating on "
          f"the engine) read to their end within {last_stream:.2f} s; (exit status, seconds after SIGTERM): {exits}")


async def test_sigterm_drains_the_engine_pod(serving: LocalCluster, engine):
    """The kubelet's stop of the engine pod: SIGTERM to the scheduler, the executor (a sidecar)
    after it exited. 16 streams in flight finish whole; health turns NOT_SERVING and a new call gets
    UNAVAILABLE; both exit 0, within the pod's termination grace."""
    pod = serving.pods[ENGINE]
    spec = pod_spec(pod.workload)
    preStop = max(prestop_seconds(c) for c in spec["containers"])
    first_token = [asyncio.Event() for _ in range(DRAIN_STREAMS)]
    streams = [asyncio.ensure_future(record_stream(engine, greedy_request(PROMPT, DRAIN_MAX_TOKENS), timeout=120,
                                                   on_delta=first_token[i])) for i in range(DRAIN_STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_token)), timeout=60)
    assert not any(s.done() for s in streams), "a stream ended before SIGTERM: raise DRAIN_MAX_TOKENS"
    signalled: list[float] = []
    stopping = asyncio.ensure_future(asyncio.to_thread(
        serving.stop_pod, ENGINE, spec["terminationGracePeriodSeconds"] - preStop, signalled.append))
    address = f"127.0.0.1:{pod.local_port(50051, 'test client')}"
    deadline = time.monotonic() + 10
    while not signalled or await _health(address, "tokenmill.v1.Generation") != "NOT_SERVING":
        assert time.monotonic() < deadline, "health never turned NOT_SERVING after SIGTERM"
        await asyncio.sleep(0.05)
    refused = await record_stream(engine, greedy_request(PROMPT, 4), timeout=10)
    assert refused.code == grpc.StatusCode.UNAVAILABLE and not refused.messages, (refused.code, refused.details)
    records = await asyncio.gather(*streams)
    for record in records:
        assert record.finish_reason == "length", (record.code, record.details, record.finish_reason)
        assert len(record.token_ids) == DRAIN_MAX_TOKENS
    assert all(r.ended_at > signalled[0] for r in records)  # every one was in flight at SIGTERM
    exits = await stopping
    assert exits["scheduler"][0] == 0 and exits["executor"][0] == 0, (exits, serving.log(ENGINE, "scheduler")[-2000:])
    assert exits["executor"][1] >= exits["scheduler"][1]
    assert preStop + exits["executor"][1] <= spec["terminationGracePeriodSeconds"], exits
    # Speculation is on in the manifest: the scheduler held a Propose stream with the drafter,
    # reached through its Service, which its stop has now closed.
    assert _rpc_count(_scrape(_metrics_port(serving, "tokenmill-drafter")), "Propose") >= 1
    last_stream = max(r.ended_at for r in records) - signalled[0]
    print(f"drain: {DRAIN_STREAMS} streams in flight at SIGTERM finished within {last_stream:.2f} s; "
          f"(exit status, seconds after SIGTERM): {exits}")


def test_a_cluster_whose_start_fails_leaves_no_process_running(tmp_path):
    # A start that times out (here at once: no probe can answer in 0 s) stops the pods it spawned,
    # so a failed fixture leaves no services running beside the rest of the suite.
    local = _local_cluster(tmp_path)
    with pytest.raises(ManifestError, match="probe still"):
        local.start(startup_timeout_s=0.0)
    spawned = [process for pod in local.pods.values() for process in pod.processes.values()]
    assert spawned and all(process.poll() is not None for process in spawned), [p.args[:3] for p in spawned]
