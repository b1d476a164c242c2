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
        ("scheduler", ["--max-num-seqs", "TOKENMILL_MAX_NUM_SEQS", "--long-prefill-token-threshold",
                       "TOKENMILL_SCHEDULER_METRICS_PORT", "TOKENMILL_SCHEDULER_PORT"]),
        ("gateway", ["--config", "--http-port", "TOKENMILL_GATEWAY_HTTP_PORT", "--backend-tls-ca"]),
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
    assert serve_main(["frobnicator"]) == 2
    assert "unknown service 'frobnicator'" in capsys.readouterr().err
    assert serve_main([]) == 0
    assert "tokenizer,executor,drafter,scheduler,gateway" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("service", "argv", "message"),
    [
        ("executor", ["--block-size", "3"], "block_size must be a positive power of two, got 3"),
        ("drafter", ["--ngram-min", "0"], "min_ngram must be in [1, max_ngram=4], got min_ngram=0"),
        ("scheduler", ["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
        ("tokenizer", ["--max-message-bytes", "100"], "max_message_bytes must be >= 4096, got 100"),
        ("executor", ["--gc-young-threshold", "-1"], "gc_young_threshold must be >= 0 (0 = Python's defaults), got -1"),
        ("scheduler", ["--auth-tokens-file", "/nonexistent/tokens.json"],
         "auth_tokens_file /nonexistent/tokens.json: cannot read it: No such file or directory"),
        ("executor", ["--host", "0.0.0.0"],
         "executor: --host 0.0.0.0 without client certificates (--tls-cert and --tls-client-ca) would let anyone "
         "who reaches the port drive the executor; require mTLS, bind loopback, or pass --allow-insecure-bind"),
        ("executor", ["--max-concurrent-rpcs", "-1"], "max_concurrent_rpcs must be >= 0 (0 = no bound), got -1"),
    ],
)
def test_bad_settings_end_the_process_before_it_binds(service, argv, message, capsys) -> None:
    # Checked before anything is bound, connected or loaded: exit 2 and one line, like a bad flag.
    assert tokenmill(["serve", service, *argv]) == 2
    assert capsys.readouterr().err.strip() == f"tokenmill serve {service}: error: {message}"
