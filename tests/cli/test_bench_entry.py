"""``tokenmill bench``: a thin entry point that finds the benchmark in the checkout by name."""

from __future__ import annotations

import sys

import pytest

from services.cli import bench
from services.cli.main import main as tokenmill


def test_bench_help_is_the_drivers_under_the_commands_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        tokenmill(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tokenmill bench ")
    for flag in ("--preset", "--systems", "--torch-threads", "--slo-ttft-ms"):
        assert flag in out


def test_without_a_checkout_bench_says_what_it_needs(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # None in sys.modules makes the import fail as if benchmarks/ were not there.
    monkeypatch.setitem(sys.modules, bench.DRIVER, None)
    assert bench.main(["--preset", "quick"]) == 2
    err = capsys.readouterr().err
    assert "needs a checkout of the tokenmill repository" in err
    assert "benchmarks.serving.driver not importable" in err and str(bench.REPO_ROOT) in err


def test_a_missing_dependency_of_the_benchmark_is_not_mistaken_for_a_missing_checkout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def import_module(name: str):
        raise ModuleNotFoundError("No module named 'tqdm'", name="tqdm")

    monkeypatch.setattr(bench.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError, match="tqdm"):
        bench.main(["--preset", "quick"])
