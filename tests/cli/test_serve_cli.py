"""``tokenmill serve SERVICE``: dispatch to each service's main, flags from its config."""

from __future__ import annotations

import pytest

from services.cli.main import main as tokenmill
from services.cli.serve import main as serve_main


@pytest.mark.parametrize(
    ("service", "flags"),
    [
        ("tokenizer", ["--port-file", "--model", "TOKENMILL_TOKENIZER_PORT"]),
        ("executor", ["--num-blocks", "--kv-cache-bytes", "--attention-backend", "TOKENMILL_EXECUTOR_PORT"]),
        ("drafter", ["--num-speculative-tokens", "--ngram-max", "TOKENMILL_DRAFTER_PORT"]),
    ],
)
def test_serve_dispatches_to_the_service(service: str, flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        tokenmill(["serve", service, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tokenmill serve {service} ")
    for flag in flags:
        assert flag in out


def test_serve_rejects_an_unknown_service(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(["gateway"]) == 2
    assert "unknown service 'gateway'" in capsys.readouterr().err
    assert serve_main([]) == 0
    assert "tokenizer,executor,drafter,scheduler" in capsys.readouterr().out
