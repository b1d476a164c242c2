"""The gateway's settings: one dataclass gives flags, environment variables and help; a bad routes
file or value stops the process before anything binds, with one line naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.common.settings import parse_config
from services.gateway.config import GatewayServiceConfig
from tests.helpers.service_harness import REPO_ROOT


def test_flags_and_environment_come_from_the_dataclass(tmp_path):
    routes = tmp_path / "routes.yaml"
    routes.write_text("targets: [{name: a, address: '127.0.0.1:1'}]\nmodels: {m: a}\n")
    config = parse_config(GatewayServiceConfig, ["--config", str(routes), "--http-port", "0"],
                          env={"TOKENMILL_GATEWAY_MAX_ATTEMPTS": "2", "TOKENMILL_GATEWAY_TOOL_CALL_PARSER": "hermes"})
    assert (config.config, config.http_port, config.max_attempts, config.port) == (str(routes), 0, 2, 50050)
    assert config.tool_call_parser == "hermes"
    assert parse_config(GatewayServiceConfig, ["--config", str(routes)], env={}).tool_call_parser == "auto"
    assert parse_config(GatewayServiceConfig, ["--config", str(routes)], env={}).reasoning_parser == "none"
    assert parse_config(GatewayServiceConfig, ["--config", str(routes), "--reasoning-parser", "qwen3"],
                        env={}).reasoning_parser == "qwen3"
    config.validate()


@pytest.mark.parametrize("setup, message", [
    (lambda d: [], "config: a routes file is required"),
    (lambda d: ["--config", str(d / "missing.yaml")], "cannot read it"),
    (lambda d: ["--config", _write(d, {"targets": [{"name": "a", "address": "h:1"}], "models": {"m": "b"}})],
     "models.m.route: unknown target 'b'"),
    (lambda d: ["--config", _write(d, {"targets": [{"name": "a", "address": "h:1"}], "models": {"m": "a"}}),
                "--max-attempts", "0"], "max_attempts must be >= 1"),
    (lambda d: ["--config", _write(d, {"targets": [{"name": "a", "address": "h:1"}], "models": {"m": "a"}}),
                "--tool-call-parser", "qwen"], "tool_call_parser must be one of ['auto', 'none', 'hermes', "),
    (lambda d: ["--config", _write(d, {"targets": [{"name": "a", "address": "h:1"}],
                                       "models": {"m": {"route": "a", "tool_call_parser": "xml"}}})],
     "models.m.tool_call_parser must be one of"),
    (lambda d: ["--config", _write(d, {"targets": [{"name": "a", "address": "h:1"}], "models": {"m": "a"}}),
                "--reasoning-parser", "think"], "reasoning_parser must be one of ['none', 'deepseek_r1', 'qwen3']"),
    (lambda d: ["--config", _write(d, {"targets": [{"name": "a", "address": "h:1"}],
                                       "models": {"m": {"route": "a", "reasoning_parser": "r1"}}})],
     "models.m.reasoning_parser must be one of"),
    # A tokenizer that does not load is the routes file's fault: the gateway does not start (it
    # once started, and answered every completion 400 naming the server's path).
    (lambda d: ["--config", _write(d, {"targets": [{"name": "a", "address": "h:1"}],
                                       "models": {"m": {"route": "a", "tokenizer": "models/none"}}})],
     "models.m.tokenizer: tokenizer "),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, setup, message):
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "services.gateway", *setup(tmp_path)], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def _write(directory, routes) -> str:
    path = directory / "routes.json"
    path.write_text(json.dumps(routes))
    return str(path)


def test_an_unexpected_fault_is_a_500_that_names_nothing_of_the_server():
    from services.gateway.http.errors import from_error
    from services.gateway.http.tokens import TokenizerLoadError

    for exc in (TokenizerLoadError("tokenizer /srv/secret/models/m: cannot load it"), RuntimeError("/srv/secret")):
        error = from_error(exc)
        assert error.status == 500 and "/srv" not in error.message, error.message
    assert from_error(ValueError("max_tokens 9 must be <= 8")).status == 400
