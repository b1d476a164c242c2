"""What a run's requests recorded, and the statistics computed from them.

Every system of the serving benchmark fills the same RequestRecord (and the other runs that
stream through the services, through harness.client): when the request was sent, when each chunk of
output tokens became available (one chunk per engine step without speculation), when it
finished. All times are time.perf_counter() seconds in the benchmark process; for the
services they are client-side (what a caller sees), for the in-process engine and the
Hugging Face baselines they are taken right after the step that produced the tokens.

Definitions (per request, n = output tokens):
    TTFT = first chunk - sent          e2e  = finish - sent
    TPOT = (last chunk - first chunk) / (n - 1)        (n >= 2)
    ITL  = gaps between consecutive chunks
Throughput divides by the run's wall time (first send to last finish). A request is "good"
for goodput when it meets every SLO given (TTFT, TPOT, e2e).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.harness.stats import distribution_ms


@dataclass(slots=True)
class RequestRecord:
    index: int
    prompt_len: int
    expected_output_len: int
    send_time: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_time: float | None = None
    error: str | None = None

    def add_chunk(self, now: float, token_ids) -> None:
        if token_ids:
            self.chunk_times.append(now)
            self.chunk_sizes.append(len(token_ids))
            self.output_ids.extend(token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_time is not None and bool(self.chunk_times)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e_s(self) -> float:
        return self.finish_time - self.send_time

    @property
    def tpot_s(self) -> float | None:
        n = self.num_output_tokens
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1) if n > 1 else None

    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True, slots=True)
class KVSample:
    time: float
    usage: float
    """Fraction of KV blocks held by requests."""
    waste: float | None
    """Allocated-but-empty slots over allocated slots (services/scheduler/core/kv_slots.py); None when unknown."""
    num_running: int = 0


@dataclass(slots=True)
class SystemRun:
    name: str
    records: list[RequestRecord]
    start: float
    end: float
    kv_samples: list[KVSample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    """System-specific figures (step breakdown, HF padding waste, server-side profile)."""


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        return self.e2e_ms is None or record.e2e_s * 1000 <= self.e2e_ms

    def as_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


def kv_summary(samples: list[KVSample]) -> dict:
    """Peak usage; waste averaged over time (each sample weighted by the time to the next) and at peak."""
    if not samples:
        return {"peak_usage": None, "mean_waste": None, "waste_at_peak_usage": None, "num_samples": 0}
    peak = max(samples, key=lambda s: s.usage)
    weighted = total = 0.0
    for sample, following in zip(samples, samples[1:]):
        if sample.waste is not None and sample.usage > 0:
            span = following.time - sample.time
            weighted += sample.waste * span
            total += span
    if total == 0:  # a run shorter than two samples: the plain mean of what there is
        busy = [s.waste for s in samples if s.waste is not None and s.usage > 0]
        weighted, total = sum(busy), len(busy)
    return {
        "peak_usage": peak.usage,
        "mean_waste": weighted / total if total > 0 else None,
        "waste_at_peak_usage": peak.waste,
        "num_samples": len(samples),
    }


def summarize(run: SystemRun, slo: SLO) -> dict:
    done = [r for r in run.records if r.ok]
    duration = run.end - run.start
    output_tokens = sum(r.num_output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    good = [r for r in done if slo.met_by(r)]
    short = [r.index for r in done if r.num_output_tokens != r.expected_output_len]
    return {
        "num_requests": len(run.records),
        "completed": len(done),
        "failed": len(run.records) - len(done),
        "requests_with_wrong_output_len": short,
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput_rps": len(done) / duration if duration > 0 else 0.0,
        "output_throughput_tps": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput_tps": (prompt_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s()]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
        "goodput_rps": len(good) / duration if duration > 0 else 0.0,
        "good_fraction": len(good) / len(run.records) if run.records else 0.0,
        "kv_cache": kv_summary(run.kv_samples),
        "notes": list(run.notes),
        **run.extra,
    } | _cpu_efficiency(run.extra.get("cpu_seconds"), output_tokens)


def _cpu_efficiency(cpu_seconds: float | None, output_tokens: int) -> dict:
    if not cpu_seconds:
        return {}
    return {"output_tokens_per_cpu_second": output_tokens / cpu_seconds}


def throughput_timeline(run: SystemRun, bin_s: float) -> tuple[list[float], list[float]]:
    """Output tokens/s in consecutive bins from the run's start: (bin start times, rates)."""
    duration = max(run.end - run.start, bin_s)
    bins = [0.0] * (int(duration / bin_s) + 1)
    for record in run.records:
        for when, size in zip(record.chunk_times, record.chunk_sizes):
            bins[min(int((when - run.start) / bin_s), len(bins) - 1)] += size
    return [i * bin_s for i in range(len(bins))], [count / bin_s for count in bins]
