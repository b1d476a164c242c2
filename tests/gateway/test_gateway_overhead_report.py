"""The gateway overhead benchmark's report: each way's TTFT p50 and p99, and what the gateway
adds over the engine's gRPC API, through its HTTP API and through its gRPC API (the hop alone)."""

from __future__ import annotations

import pytest

from benchmarks.gateway.overhead import _summary


def test_the_report_gives_each_way_its_p50_p99_and_the_added_time():
    results = {"grpc": {"ttft": [float(x) for x in range(1, 101)], "tps": [100.0, 300.0]},
               "gateway_grpc": {"ttft": [float(x) + 1 for x in range(1, 101)], "tps": []},
               "http": {"ttft": [float(x) + 2 for x in range(1, 100)] + [500.0], "tps": [100.0, 200.0]}}
    out = _summary(results, gateway_us=50.0, engine_us=150.0)
    assert out["grpc"]["ttft_p50_ms"] == 50.5 and out["grpc"]["ttft_p99_ms"] == 100.0
    assert out["ttft_p50_added_ms"] == pytest.approx(2.0)
    assert out["ttft_p99_added_ms"] == pytest.approx(400.0)  # the HTTP way's one slow request is its p99
    assert out["hop_p50_added_ms"] == pytest.approx(1.0) and out["hop_p99_added_ms"] == pytest.approx(1.0)
    assert "tokens_per_s" not in out["gateway_grpc"]  # that way times TTFT only
    assert out["tokens_per_s_ratio"] == pytest.approx(150.0 / 200.0)
    assert out["cpu_bound_ratio"] == pytest.approx(0.75)
