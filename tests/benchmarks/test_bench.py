"""The serving benchmark end to end on a tiny workload (stories260K, all four systems), its settings
and its workload builder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import main as benchmarks
from benchmarks.harness import paths
from benchmarks.serving import driver
from benchmarks.serving.workload import LengthDist, WorkloadSpec, build_workload

# slow: runs the serving benchmark end to end (four service processes, HF baselines)
pytestmark = pytest.mark.slow

DISTRIBUTION_KEYS = {"mean", "p50", "p90", "p99", "max", "count"}
SYSTEMS = {"tokenmill_services", "tokenmill_inprocess", "hf_sequential", "hf_static"}
NUM_REQUESTS = 4
HF_SEQUENTIAL_REQUESTS = 3
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    # Outputs of 48-64 tokens: the services' KV usage is sampled by polling GetProfile every
    # 20 ms, and with outputs of 16-24 the whole run (~0.1 s, multi-step bursts) once fit
    # between two samples, so the peak read 0.
    # The default output folder, redirected: the run must find it without --out-dir.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paths, "RESULTS_DIR", out)
        code = benchmarks(["serving", "--preset", "quick", "--num-requests", str(NUM_REQUESTS), "--concurrency", "2",
                           "--prompt-len", "6:12", "--output-len", "48:64", "--hf-sequential-requests",
                           str(HF_SEQUENTIAL_REQUESTS), "--name", "tiny", "--no-progress",
                           "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                           # The suite runs single-threaded (root conftest); the default would be every core.
                           "--torch-threads", "1"])
    assert code == 0
    png = (out / "tiny.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    return json.loads((out / "tiny.json").read_text())


def test_result_names_every_headline_field(result):
    for key in ("throughput_ratio_vs_hf_sequential", "throughput_ratio_vs_hf_static",
                "throughput_ratio_services_vs_inprocess"):
        assert isinstance(result[key], float) and result[key] > 0, key
    machine = result["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch_threads"] >= 1 and machine["torch_version"]
    assert result["date"] and result["command"].startswith("python -m benchmarks serving ")
    assert result["git"]["commit"] and len(result["load_average"]) == 2
    assert "--num-requests 4" in result["command"]
    assert result["hf_sequential_requests"] == HF_SEQUENTIAL_REQUESTS and result["hf_sequential_subset"] is True
    assert result["summary"].startswith("tokenmill_services: ")
    assert f"first {HF_SEQUENTIAL_REQUESTS} requests" in result["summary"]
    assert all(isinstance(v, float) and v > 0 for v in result["cpu_efficiency_ratios"].values())
    assert set(result["goals"]) == {"throughput_vs_hf_sequential", "throughput_vs_hf_static",
                                    "services_vs_inprocess", "kv_waste_mean"}


def test_every_system_measured_the_same_work(result):
    systems = result["systems"]
    assert set(systems) == SYSTEMS
    for name, s in systems.items():
        expected = HF_SEQUENTIAL_REQUESTS if name == "hf_sequential" else NUM_REQUESTS
        assert (s["num_requests"], s["completed"], s["failed"]) == (expected, expected, 0), name
        assert s["requests_with_wrong_output_len"] == [], name
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(s[metric]) == DISTRIBUTION_KEYS, (name, metric)
            assert 0 < s[metric]["p50"] <= s[metric]["p99"] <= s[metric]["max"], (name, metric)
        assert s["request_throughput_rps"] > 0 and s["output_throughput_tps"] > 0
        assert s["cpu_seconds"] > 0 and s["output_tokens_per_cpu_second"] > 0, name
        assert s["goodput_rps"] == pytest.approx(s["request_throughput_rps"])  # the SLO is loose: all good
    # Greedy, same prompts, same lengths: the same output tokens in every system.
    assert result["output_match_vs_inprocess"] == {"tokenmill_services": 1.0, "hf_sequential": 1.0, "hf_static": 1.0}
    assert systems["tokenmill_services"]["server_profile"]["num_requests"] == NUM_REQUESTS


def test_kv_usage_and_waste_and_step_breakdown(result):
    systems = result["systems"]
    for name in ("tokenmill_services", "tokenmill_inprocess"):
        kv = systems[name]["kv_cache"]
        assert 0 < kv["peak_usage"] <= 1, name
        assert 0 <= kv["mean_waste"] < 1, name
        steps = systems[name]["step_breakdown"]
        assert steps["steps"] >= 6 and steps["mean_batch_size"] >= 1, name
        assert steps["execute_ms_mean"] > 0, name
    assert 0 < systems["hf_static"]["kv_padding_waste_mean"] < 1
    assert systems["hf_sequential"]["kv_padding_waste_mean"] == 0.0
    gap = result["services_gap"]
    assert gap["codec_estimate_ms_per_step"] > 0
    causes = gap["extra_ms_per_output_token_by_cause"]
    per_token = gap["wall_ms_per_output_token"]
    # The causes partition the difference in wall time per output token.
    assert sum(causes.values()) == pytest.approx(per_token["services"] - per_token["inprocess"], rel=1e-6, abs=1e-6)


def test_workload_is_seeded_and_shares_prefixes():
    spec = WorkloadSpec(num_requests=20, prompt_len=LengthDist(40, 80), output_len=LengthDist.parse("5:9", "out"),
                        concurrency=4, request_rate=10.0, shared_prefix_fraction=0.5, seed=7)
    first = build_workload(spec, vocab_size=512, max_model_len=512)
    assert first == build_workload(spec, vocab_size=512, max_model_len=512)
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first) and first[0].arrival_s == 0.0
    assert 0.5 < first[-1].arrival_s < 5.0  # 19 gaps of mean 0.1 s
    for r in first:
        assert 40 <= len(r.prompt_ids) <= 80 and 5 <= r.output_len <= 9
        assert all(3 <= t < 512 for t in r.prompt_ids)
        shared = min(round(0.5 * len(r.prompt_ids)), round(0.5 * len(first[0].prompt_ids)))
        assert r.prompt_ids[:shared] == first[0].prompt_ids[:shared]
    assert len({r.prompt_ids[-1] for r in first}) > 10  # the tails are not shared
    with pytest.raises(ValueError, match="max_model_len 60"):
        build_workload(spec, vocab_size=512, max_model_len=60)
    with pytest.raises(ValueError, match="--prompt-len"):
        LengthDist.parse("9:3", "--prompt-len")


def test_bad_arguments_are_refused_before_running(capsys):
    for argv, message in ((["--systems", "inprocess,bogus"], "--systems: unknown bogus"),
                          (["--torch-threads", "0"], "--torch-threads must be at least 1, got 0"),
                          (["--attention-backend", "flash"], "--attention-backend: unknown 'flash'"),
                          (["--max-num-seqs", "0"], "max_num_seqs")):
        with pytest.raises(SystemExit) as exc:
            benchmarks(["serving", "--preset", "quick", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: python -m benchmarks serving") and message in err, err
    assert benchmarks(["serving", "--preset", "quick", "--output-len", "600"]) == 2  # stories260K's context is 512
    assert "does not fit max_model_len 512" in capsys.readouterr().err


def test_both_tokenmill_systems_get_the_same_engine_settings():
    settings = driver.ServingSettings(kv_cache_bytes=1 << 20)
    executor = settings.engine.executor_config("m", settings.pool_bytes())
    flags = settings.engine.executor_flags(executor)
    assert "--model" not in flags and flags[flags.index("--kv-cache-bytes") + 1] == str(1 << 20)
    assert flags[flags.index("--dtype") + 1] == "fp32" and "--no-compile" in flags
    assert driver.ServingSettings().pool_bytes() == driver.presets.PRESETS["quick"].kv_cache_bytes
    limits = settings.engine.scheduler_flags()
    assert limits[limits.index("--max-num-seqs") + 1] == "256" and "--overlap-scheduling" in limits


def test_the_entry_runs_as_a_module_and_lists_the_runs():
    result = subprocess.run([sys.executable, "-m", "benchmarks", "serving", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: python -m benchmarks serving ")
    for flag in ("--preset", "--systems", "--torch-threads", "--slo-ttft-ms", "--max-num-seqs", "--block-size"):
        assert flag in result.stdout
    listing = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0 and "serving" in listing.stdout and "step-codec" in listing.stdout
