"""The benchmarks run from a checkout (``python -m benchmarks``), not through the installed CLI;
``tokenmill bench`` says where they went."""

from __future__ import annotations

import pytest

from services.cli.main import COMMANDS, main as tokenmill


def test_tokenmill_bench_points_to_the_checkout_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert "bench" not in COMMANDS
    assert tokenmill(["bench", "--preset", "quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill bench: the benchmarks are not part of the installed package")
    assert "python -m benchmarks serving --preset headline" in err
    tokenmill(["--help"])
    assert "bench" not in capsys.readouterr().out
