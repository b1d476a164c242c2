"""The benchmark harness: every run's flags, the settings it shares with the engine, and its plumbing."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import typing

import pytest

from benchmarks.__main__ import ENTRIES, MICRO, RUNS, main as benchmarks
from benchmarks.harness import child, flags, paths, report
from benchmarks.harness.cpu import CpuMeter, proc_status, thread_cpu_seconds
from benchmarks.harness.launch import QUIET_LOGS, LaunchSpec, executor_flags, scheduler_flags
from benchmarks.harness.records import RequestRecord
from benchmarks.harness.scrape import moved
from benchmarks.harness.stats import distribution_ms, percentile
from services.common.settings import field_help, parse_config
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.core.config import SchedulerLimits
from services.common.latency_profile import percentile as profile_percentile


@pytest.mark.parametrize("name", sorted(ENTRIES), ids=lambda name: f"run {name}")
def test_every_run_has_its_flags_from_its_settings(name, capsys):
    with pytest.raises(SystemExit) as exc:
        benchmarks([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m benchmarks {name}"), out[:200]


def test_the_listing_names_runs_and_micro_benchmarks_and_refuses_others(capsys):
    assert benchmarks([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in RUNS) and all(name in out for name in MICRO)
    assert out.index("micro-benchmarks") > max(out.index(name) for name in RUNS)
    assert benchmarks(["bench"]) == 2
    assert "unknown run 'bench'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- flags from dataclasses


@dataclasses.dataclass
class EngineLike:
    block_size: int = dataclasses.field(default=16, metadata={"help": "tokens per block"})
    pool_bytes: int = 1024
    """Bytes of the pool.

    Only the first paragraph is the help."""


@dataclasses.dataclass(frozen=True)
class Demo:
    block_size: int = flags.config_field(EngineLike, "block_size")
    pool_bytes: int | None = flags.config_field(EngineLike, "pool_bytes", default=None, note="(run's)")
    rounds: int = flags.setting(2)
    """Rounds."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "rounds")


def test_a_config_field_takes_the_engines_name_default_and_help(capsys):
    assert Demo() == Demo(16, None, 2)
    assert flags.parse(Demo, ["--block-size", "32", "--rounds", "3"], prog="demo") == Demo(32, None, 3)
    with pytest.raises(SystemExit):
        flags.parse(Demo, ["--help"], prog="demo")
    text = " ".join(capsys.readouterr().out.split())
    assert "--block-size BLOCK_SIZE tokens per block (default: 16)" in text  # the field's metadata
    assert "--pool-bytes POOL_BYTES Bytes of the pool. (run's) (default: none)" in text  # else its docstring
    with pytest.raises(SystemExit) as exc:
        flags.parse(Demo, ["--rounds", "0"], prog="demo")
    assert exc.value.code == 2 and "demo: error: --rounds must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(AttributeError, match="no field 'blocksize'"):
        flags.config_field(ExecutorConfig, "blocksize")
    executor_help = {f.name: field_help(ExecutorConfig, f, first_paragraph=True)
                     for f in dataclasses.fields(ExecutorConfig)}
    from benchmarks.harness.engine import EngineSettings
    ours = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineSettings) if "help" in f.metadata}
    assert ours["block_size"] == executor_help["block_size"] != ""


def test_engine_settings_are_the_engines_own_fields():
    from benchmarks.harness.engine import EngineSettings
    from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings

    ours = typing.get_type_hints(EngineSettings)
    for source, names in ((ExecutorConfig, ("block_size", "attention_backend")), (CompiledDecodeSettings, ("compile",))):
        theirs = typing.get_type_hints(source)
        defaults = source()
        for name in names:
            assert ours[name] == theirs[name] and getattr(EngineSettings(), name) == getattr(defaults, name), name
    assert ours["limits"] is SchedulerLimits and EngineSettings().limits == SchedulerLimits()


def test_the_services_get_exactly_the_in_process_engines_config():
    from benchmarks.harness.engine import EngineSettings
    from services.executor.forward_paths.fused_decode import FusedDecodeSettings

    settings = EngineSettings(block_size=32, compile=True,
                              limits=SchedulerLimits(max_num_seqs=7, overlap_scheduling=False))
    config = settings.executor_config("/models/m", 12345, fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=8))
    assert config.compiled_decode.compile
    served = parse_config(ExecutorServiceConfig, ["--model", "/models/m", *settings.executor_flags(config)],
                          env={"TOKENMILL_EXECUTOR_BLOCK_SIZE": "64"})  # the flags win over the environment
    assert served.executor == config
    scheduler = parse_config(SchedulerServiceConfig, settings.scheduler_flags(),
                             env={"TOKENMILL_MAX_NUM_SEQS": "99"})
    assert scheduler.limits == settings.limits
    assert executor_flags(ExecutorConfig(model="m", num_blocks=8), only_changed=True) == ["--num-blocks", "8"]
    assert executor_flags(ExecutorConfig(num_blocks=8), only_changed=True) == ["--num-blocks", "8"]
    assert scheduler_flags(SchedulerLimits(max_num_seqs=2), only_changed=True) == ["--max-num-seqs", "2"]


def test_a_runs_embedded_limits_take_its_own_defaults():
    from benchmarks.fairness import FairnessSettings

    assert flags.parse(FairnessSettings, [], prog="f").limits.max_num_seqs == 8
    parsed = flags.parse(FairnessSettings, ["--max-num-seqs", "4", "--no-overlap-scheduling"], prog="f")
    assert parsed.limits == SchedulerLimits(max_num_seqs=4, overlap_scheduling=False)


# ---------------------------------------------------------------------------- statistics and records


def test_one_percentile_the_servers_and_nan_for_nothing():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == profile_percentile(values, q)
    assert percentile(values, 90) == pytest.approx(4.6)  # interpolated between the closest ranks
    assert math.isnan(percentile([], 99))
    assert distribution_ms([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    assert distribution_ms([0.001, 0.003])["p50"] == pytest.approx(2.0)


def test_a_record_times_its_chunks():
    record = RequestRecord(0, prompt_len=4, expected_output_len=3, send_time=10.0)
    record.add_chunk(10.5, [7])
    record.add_chunk(10.7, [])  # an empty delta is no chunk
    record.add_chunk(11.5, [8, 9])
    record.finish_time = 11.6
    assert record.ok and record.output_ids == [7, 8, 9] and record.chunk_sizes == [1, 2]
    assert (record.ttft_s, record.tpot_s, record.e2e_s) == pytest.approx((0.5, 0.5, 1.6))


def test_counters_moved_and_cpu_of_processes():
    assert moved({"a": 1.0}, {"a": 4.0, "b": 2.0}, "a") == 3.0 and moved({}, {"b": 2.0}, "b") == 2.0
    meter = CpuMeter()
    meter.start()
    sum(range(3_000_000))
    assert meter.stop() > 0 and meter.own_seconds == meter.seconds
    import os

    status = proc_status(os.getpid())
    assert status.rss_kib > 1000 and status.threads >= 1 and status.cpu_seconds > 0
    assert sum(thread_cpu_seconds(os.getpid()).values()) > 0
    with pytest.raises(ProcessLookupError):
        proc_status(2**22 + 12345)


# ---------------------------------------------------------------------------- launch, child, report


def test_a_launch_adds_metrics_ports_logs_threads_and_the_checkout():
    config, scheduler_port, executor_port = LaunchSpec("m", ("--dtype", "fp32"), ("--max-num-seqs", "2"),
                                                       threads=3).launch_config()
    assert config.executor_args == ["--dtype", "fp32", "--metrics-port", str(executor_port)]
    assert config.scheduler_args == ["--max-num-seqs", "2", "--metrics-port", str(scheduler_port)]
    assert scheduler_port != executor_port and not config.restart and config.public_port == 0
    assert config.env["OMP_NUM_THREADS"] == config.env["MKL_NUM_THREADS"] == "3"
    assert config.env["PYTHONPATH"].split(":")[0] == str(paths.REPO_ROOT)
    assert QUIET_LOGS.items() <= config.env.items()
    bare, none, _ = LaunchSpec("m", threads=None, quiet=False, metrics=False, python_path="/trace").launch_config()
    assert none is None and bare.executor_args == [] and "OMP_NUM_THREADS" not in bare.env
    assert bare.env["PYTHONPATH"].startswith("/trace:") and "TOKENMILL_LOG_LEVEL" not in bare.env


def test_a_child_process_runs_a_function_and_returns_its_result():
    done = subprocess.run(child.command("json:dumps", obj=[1, 2], indent=None), cwd=child.CWD,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert child.result(done.stdout) == "[1, 2]"
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        child.command("json.dumps")


def test_a_result_carries_command_commit_machine_and_load(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS_DIR", tmp_path)
    load = report.LoadWatch()
    assert len(load.stop()) == 2
    result = report.provenance(report.command_line("python -m benchmarks demo", ["--x", "a b"]), load)
    assert result["command"] == "python -m benchmarks demo --x 'a b'"
    assert len(result["git"]["commit"]) == 40 and result["git"]["short"] == result["git"]["commit"][:7]
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["cpu"]
    assert result["load_average"] == [load.before, load.after]
    path = report.write_result(result | {"figure": 1.5}, report.result_path("demo", name="one"))
    assert path == tmp_path / "one.json" and json.loads(path.read_text())["figure"] == 1.5
    assert report.result_path("demo").name.startswith("demo-")
