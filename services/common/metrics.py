"""Prometheus metrics shared by every tokenmill service.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` ...) with a ``tokenmill:`` prefix,
so dashboards built for vLLM need only the prefix changed. Each service is its own process,
so everything registers in prometheus_client's default registry unless a test passes its own.

    start_metrics_server(port)          HTTP /metrics on a daemon thread; returns the bound port
    RpcMetricsInterceptor()             tokenmill:rpc_latency_seconds{service,method}, every service
    request_metrics().observe_finished  the scheduler's per-request histograms and token counters
    SchedulerCollector                  gauges and counters read from the scheduler at scrape time
    executor_metrics()                  the executor's compute time per step
    expert_load_collector()             a mixture-of-experts model's tokens per expert per layer

Gauges are read at scrape time by a custom collector rather than pushed after every step:
the step loop pays nothing for them, and a scrape always sees the current state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import grpc.aio
import structlog
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.interceptor import BehaviorInterceptor, StreamBehavior, UnaryBehavior

PREFIX = "tokenmill:"

_log = structlog.get_logger("tokenmill.metrics")

# Buckets as vLLM's, so histograms are comparable across the two engines.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
RPC_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STEP_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                        1.0, 2.5, 5.0, 10.0)

_lock = threading.Lock()
_per_registry: dict[tuple[int, str], Any] = {}
"""(id(registry), kind) -> metric set; a process (or a test run) creates each set once."""


def _once(registry: CollectorRegistry, kind: str, make: Callable[[], Any]) -> Any:
    # prometheus_client refuses a second metric of the same name in one registry; tests start
    # several servers in one process, so every set is built once per registry and shared.
    with _lock:
        key = (id(registry), kind)
        if key not in _per_registry:
            _per_registry[key] = make()
        return _per_registry[key]


# ---------------------------------------------------------------------------- HTTP endpoint
_servers: dict[int, Any] = {}


def start_metrics_server(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> int:
    """Serve ``/metrics`` over HTTP on a daemon thread; port 0 picks a free port. Returns the bound port."""
    if port < 0 or port > 65535:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(httpd.server_address[1])
    _servers[bound] = httpd
    return bound


def stop_metrics_server(port: int) -> None:
    """Stop a server started by start_metrics_server (a no-op for an unknown port)."""
    httpd = _servers.pop(port, None)
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()


def rpc_interceptors(metrics_port: int) -> list[grpc.aio.ServerInterceptor]:
    """start_server's interceptors for a service: the RPC timer when metrics are on."""
    return [RpcMetricsInterceptor()] if metrics_port >= 0 else []


def serve_metrics(running, metrics_port: int, host: str = "127.0.0.1") -> int | None:
    """Start /metrics on ``host`` (loopback unless configured: the gRPC port may face clients,
    and the metrics are plaintext and name tenants) and stop it with the server.

    Returns the bound port (also set as ``running.metrics_port``), or None when metrics_port < 0.
    """
    if metrics_port < 0:
        return None
    port = start_metrics_server(metrics_port, host=host)
    running.metrics_port = port
    running.on_stop(lambda: stop_metrics_server(port))
    _log.info("metrics_serving", server=running.name, host=host, port=port)
    return port


# ---------------------------------------------------------------------------- per-RPC latency
def rpc_latency_histogram(registry: CollectorRegistry = REGISTRY) -> Histogram:
    return _once(registry, "rpc", lambda: Histogram(
        PREFIX + "rpc_latency_seconds",
        "Server-side duration of one RPC: handler start to its last response (whole stream for streaming calls)",
        ["service", "method"], buckets=RPC_LATENCY_BUCKETS, registry=registry))


def split_method(full_method: str) -> tuple[str, str]:
    """'/tokenmill.v1.Generation/Generate' -> ('tokenmill.v1.Generation', 'Generate')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method or full_method


class RpcMetricsInterceptor(BehaviorInterceptor):
    """Times every async handler (unary or streaming) into tokenmill:rpc_latency_seconds.

    Pass it to start_server(interceptors=[...]); it runs inside the error-mapping interceptor,
    so a failing call is timed up to the exception, before its status is sent.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.histogram = rpc_latency_histogram(registry)

    def wrap_unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        child = self.histogram.labels(*split_method(method))

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                return await behavior(request, context)
            finally:
                child.observe(time.perf_counter() - start)

        return handler

    def wrap_stream(self, behavior: StreamBehavior, method: str) -> StreamBehavior:
        child = self.histogram.labels(*split_method(method))

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                child.observe(time.perf_counter() - start)

        return handler


# ---------------------------------------------------------------------------- per-request (scheduler)
@dataclass(frozen=True, slots=True)
class RequestMetrics:
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    request_queue_time: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter

    def observe_finished(self, delta, output_state=None) -> None:
        """The scheduler loop's on_finished callback: one finished (or aborted) request.

        ``output_state.token_times`` (one timestamp per delta) gives the inter-token gaps;
        without it only the per-request histograms move.
        """
        usage, timings = delta.usage, delta.timings
        if usage is None or timings is None:
            return
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.e2e_request_latency.observe(timings.e2e_ms / 1000.0)
        self.request_queue_time.observe(timings.queue_time_ms / 1000.0)
        if usage.completion_tokens == 0:
            return  # aborted before its first token: it has no TTFT
        self.time_to_first_token.observe(timings.time_to_first_token_ms / 1000.0)
        if usage.completion_tokens > 1:
            self.time_per_output_token.observe(timings.decode_time_ms / 1000.0 / (usage.completion_tokens - 1))
        times = getattr(output_state, "token_times", None) or ()
        for earlier, later in zip(times, times[1:]):
            self.inter_token_latency.observe(later - earlier)


def request_metrics(registry: CollectorRegistry = REGISTRY) -> RequestMetrics:
    def make() -> RequestMetrics:
        def hist(name: str, help_: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, help_, buckets=buckets, registry=registry)

        return RequestMetrics(
            hist("time_to_first_token_seconds", "Arrival to first output token", TTFT_BUCKETS),
            hist("time_per_output_token_seconds", "Decode time / (output tokens - 1), per request",
                 TOKEN_LATENCY_BUCKETS),
            hist("inter_token_latency_seconds", "Gap between consecutive output deltas of one request",
                 TOKEN_LATENCY_BUCKETS),
            hist("e2e_request_latency_seconds", "Arrival to finish", REQUEST_LATENCY_BUCKETS),
            hist("request_queue_time_seconds", "Arrival to first scheduled", REQUEST_LATENCY_BUCKETS),
            Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=registry),
            Counter(PREFIX + "generation_tokens", "Output tokens of finished requests", registry=registry),
        )
    return _once(registry, "request", make)


@dataclass(frozen=True, slots=True)
class TenantMetrics:
    """Per-tenant counters, when the scheduler authenticates its callers."""

    requests: Counter
    tokens: Counter

    def observe_finished(self, tenant: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.requests.labels(tenant, finish_reason).inc()
        self.tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tokens.labels(tenant, "generation").inc(completion_tokens)


def tenant_metrics(registry: CollectorRegistry = REGISTRY) -> TenantMetrics:
    return _once(registry, "tenant", lambda: TenantMetrics(
        Counter(PREFIX + "tenant_requests", "Finished requests per tenant and finish reason",
                ["tenant", "finish_reason"], registry=registry),
        Counter(PREFIX + "tenant_tokens", "Prompt and generated tokens per tenant", ["tenant", "kind"],
                registry=registry)))


# ---------------------------------------------------------------------------- scheduler gauges
class SchedulerSource(Protocol):
    """What the collector reads from the scheduler (its EngineCore satisfies it)."""

    def stats(self): ...

    def kv_slots(self): ...

    @property
    def step_times(self): ...

    @property
    def lanes(self):
        """The executors being served, by name; each one's ``info`` (ExecutorInfo) gives its KV
        pool's capacity, its ``scheduler`` its gauges."""

    @property
    def handoff(self):
        """Its ``counters``: KV copies into each executor."""


class SchedulerCollector(Collector):
    """Reads the scheduler's state at scrape time.

    The scrape runs on the HTTP server's thread while the asyncio loop mutates the core; the
    reads are of ints and list lengths (atomic under the GIL), so a scrape can be a step
    stale but never sees a torn value.
    """

    def __init__(self) -> None:
        self.source: SchedulerSource | None = None

    def watch(self, source: SchedulerSource | None) -> None:
        """Read ``source`` at every scrape from now on (None: nothing)."""
        self.source = source

    def describe(self) -> Iterable[Metric]:
        """The metric names, valueless: the registry maps names to collectors with it, which a
        filtered scrape (``/metrics?name[]=...``) needs even before a source is set."""
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_waste_perc",
                     "kv_cache_blocks", "kv_cache_capacity_tokens", "kv_cache_bytes", "executor_num_requests_running",
                     "executor_num_requests_waiting", "executor_kv_cache_usage_perc"):
            yield GaugeMetricFamily(PREFIX + name, "")
        for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "scheduler_steps",
                     "scheduler_step_sequences", "scheduler_step_phase_seconds", "spec_decode_num_drafts",
                     "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                     "spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_draft_tokens_per_pos",
                     "executor_kv_transfers", "executor_kv_transfer_bytes", "executor_kv_transfer_seconds",
                     "executor_kv_transfer_failures", "spec_decode_invalid_drafts"):
            yield CounterMetricFamily(PREFIX + name, "")

    def collect(self) -> Iterable[Metric]:
        source = self.source
        stats = source.stats() if source is not None else None
        if stats is None:
            return
        yield from _core_stats(stats)
        slots = source.kv_slots()
        if slots is not None:
            yield _gauge("kv_cache_waste_perc",
                         "Allocated KV slots holding no token, over all allocated slots of running requests",
                         slots.waste_fraction)
        yield from _kv_capacity([lane.info for lane in source.lanes.values()])
        yield from _per_executor(source.lanes, source.handoff.counters)
        yield from _step_times(source.step_times)
        yield from _spec_decode(getattr(stats, "spec_decode", None))
        drafting = getattr(source, "drafting", None)
        if drafting is not None:
            yield _counter("spec_decode_invalid_drafts", "Drafts cut at an id outside the vocabulary (dropped there, "
                           "never sent to the executor)", drafting.num_invalid_drafts)


def _core_stats(stats) -> Iterable[Metric]:
    yield _gauge("num_requests_running", "Requests in the running batch", stats.num_running)
    yield _gauge("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting)
    yield _gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests, in [0, 1]",
                 stats.kv_cache_usage)
    yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                   stats.prefix_cache_queries)
    yield _counter("prefix_cache_hits", "Prompt tokens served from the prefix cache", stats.prefix_cache_hits)
    yield _counter("num_preemptions", "Requests preempted (blocks taken back, recomputed later)",
                   stats.num_preemptions)


def _step_times(totals) -> Iterable[Metric]:
    yield _counter("scheduler_steps", "Steps the loop sent to the executor", totals.steps)
    yield _counter("scheduler_step_sequences", "Sequences scheduled, summed over steps", totals.sequences)
    yield _counter("scheduler_detokenize_rounds",
                   "Detokenize round trips (fewer than steps when the publisher caught up on several at once)",
                   totals.detokenize_rounds)
    phases = CounterMetricFamily(PREFIX + "scheduler_step_phase_seconds",
                                 "Wall time of the step loop by phase, summed over steps", labels=["phase"])
    phases.add_metric(["schedule"], totals.schedule_s)
    phases.add_metric(["executor"], totals.executor_s)
    phases.add_metric(["update"], totals.update_s)
    yield phases


def _spec_decode(spec) -> Iterable[Metric]:
    """Speculative decoding counters, named like vLLM's; per position labelled 0, 1, ..."""
    if spec is None:
        return
    yield _counter("spec_decode_num_drafts", "Verified steps of a sequence that carried draft tokens", spec.num_drafts)
    yield _counter("spec_decode_num_draft_tokens", "Draft tokens sent for verification", spec.num_draft_tokens)
    yield _counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted", spec.num_accepted_tokens)
    for name, help_, values in (
            ("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft",
             spec.accepted_per_position),
            ("spec_decode_num_draft_tokens_per_pos", "Draft tokens sent by position in the draft",
             spec.drafted_per_position)):
        family = CounterMetricFamily(PREFIX + name, help_, labels=["position"])
        for position, value in enumerate(values):
            family.add_metric([str(position)], float(value))
        yield family


def _kv_capacity(infos) -> Iterable[Metric]:
    """The executors' KV pools together: blocks, tokens and bytes, labelled with their storage
    dtype (int8 or fp8_e4m3 when quantized), so a dashboard sees what --kv-cache-dtype bought."""
    if not infos:
        return
    first = infos[0]
    labels = {"kv_cache_dtype": first.kv_cache_dtype, "block_size": str(first.block_size)}
    for name, help_, value in (
            ("kv_cache_blocks", "KV-cache blocks the executors hold", sum(i.num_blocks for i in infos)),
            ("kv_cache_capacity_tokens", "Tokens the KV caches hold (blocks x block size)",
             sum(i.kv_cache_tokens for i in infos)),
            ("kv_cache_bytes", "Bytes of the executors' KV pools, quantization scales included",
             sum(i.kv_cache_bytes for i in infos))):
        gauge = GaugeMetricFamily(PREFIX + name, help_, labels=list(labels))
        gauge.add_metric(list(labels.values()), float(value))
        yield gauge


def _per_executor(lanes, transfers) -> Iterable[Metric]:
    """Each executor's placement and KV usage, and the KV copies into it (disaggregated prefill)."""
    families = {
        "executor_num_requests_running": GaugeMetricFamily(
            PREFIX + "executor_num_requests_running", "Requests running on the executor", labels=["executor", "role"]),
        "executor_num_requests_waiting": GaugeMetricFamily(
            PREFIX + "executor_num_requests_waiting", "Requests waiting for the executor", labels=["executor", "role"]),
        "executor_kv_cache_usage_perc": GaugeMetricFamily(
            PREFIX + "executor_kv_cache_usage_perc", "Fraction of the executor's KV blocks held, in [0, 1]",
            labels=["executor", "role"]),
    }
    for name, lane in lanes.items():
        stats = lane.scheduler.get_stats()
        labels = [name, lane.role]
        families["executor_num_requests_running"].add_metric(labels, stats.num_running)
        families["executor_num_requests_waiting"].add_metric(labels, stats.num_waiting)
        families["executor_kv_cache_usage_perc"].add_metric(labels, stats.kv_cache_usage)
    yield from families.values()
    copies = {key: CounterMetricFamily(PREFIX + key, help_, labels=["executor"]) for key, help_ in (
        ("executor_kv_transfers", "KV copies into the executor from a prefill executor"),
        ("executor_kv_transfer_bytes", "Bytes of KV copied into the executor"),
        ("executor_kv_transfer_seconds", "Time spent copying KV into the executor"),
        ("executor_kv_transfer_failures", "KV copies that failed (the request recomputed instead)"))}
    for name, counters in transfers.items():
        copies["executor_kv_transfers"].add_metric([name], counters.transfers)
        copies["executor_kv_transfer_bytes"].add_metric([name], counters.bytes)
        copies["executor_kv_transfer_seconds"].add_metric([name], counters.seconds)
        copies["executor_kv_transfer_failures"].add_metric([name], counters.failures)
    yield from copies.values()


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_, value=float(value))


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, help_, value=float(value))


def scheduler_collector(registry: CollectorRegistry = REGISTRY) -> SchedulerCollector:
    """The registry's one scheduler collector; set ``.source`` to the loop to read."""
    def make() -> SchedulerCollector:
        collector = SchedulerCollector()
        registry.register(collector)
        return collector
    return _once(registry, "scheduler", make)


# ---------------------------------------------------------------------------- executor
def executor_step_histogram(registry: CollectorRegistry = REGISTRY) -> Histogram:
    return _once(registry, "executor", lambda: Histogram(
        PREFIX + "executor_execute_seconds",
        "Executor compute per step: plan to tensors, forward, sampling (no gRPC, no codec)",
        buckets=STEP_LATENCY_BUCKETS, registry=registry))


class ExpertLoadCollector(Collector):
    """``tokenmill:executor_moe_expert_tokens_total{layer,expert}``: the tokens routed to each
    expert of each sparse layer since the executor was ready. Skewed routing is what MoE users
    debug; rate() of it over rate() of the steps is the tokens per expert per step. Read at scrape
    time from the model's running counts, so a step pays one small add per layer."""

    def __init__(self) -> None:
        self._source: Callable[[], list[tuple[int, list[int]]]] | None = None

    def watch(self, source: Callable[[], list[tuple[int, list[int]]]] | None) -> None:
        """``source()`` -> [(layer index, tokens per expert)] of the model being served."""
        self._source = source

    def describe(self) -> Iterable[Metric]:
        yield CounterMetricFamily(PREFIX + "executor_moe_expert_tokens", "", labels=["layer", "expert"])

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(PREFIX + "executor_moe_expert_tokens",
                                     "Tokens routed to each expert of each mixture-of-experts layer",
                                     labels=["layer", "expert"])
        for layer, counts in (self._source() if self._source is not None else ()):
            for expert, n in enumerate(counts):
                family.add_metric([str(layer), str(expert)], n)
        yield family


def expert_load_collector(registry: CollectorRegistry = REGISTRY) -> ExpertLoadCollector:
    def make() -> ExpertLoadCollector:
        collector = ExpertLoadCollector()
        registry.register(collector)
        return collector
    return _once(registry, "expert_load", make)


# ---------------------------------------------------------------------------- reading /metrics
def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}; for tests and the benchmark."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
