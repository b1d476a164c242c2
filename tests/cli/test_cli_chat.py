"""``tokenmill generate --chat`` (and ``tokenmill up``'s chat demo), in process and over the API.

SmolLM2-135M-Instruct answers "What is the capital of France?" with one sentence and stops at
its end-of-turn token; only the reply is printed. Argument mistakes and a model without a chat
template end with exit status 2 and one line saying why, before any model is loaded.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from services.cli import generate
from services.cli.terminal import stream_to_terminal
from services.cli.up import demo_request, has_chat_template
from services.common.pb.tokenmill.v1 import common_pb2
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher
from tests.conftest import REPO_ROOT

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("argv", "message"), [
    (["--system", "Be brief."], "--system needs --chat"),
    (["Once upon", "--chat", "Hi"], "give either a PROMPT or --chat, not both"),
])
def test_chat_argument_mistakes_exit_2(capsys, argv, message):
    assert generate.main(["--in-process", *argv]) == 2
    assert capsys.readouterr().err == f"tokenmill generate: error: {message}\n"


@pytest.mark.slow  # a subprocess that imports torch
def test_chat_needs_a_model_with_a_chat_template(stories_dir):
    done = run_cli("generate", "--in-process", "--model", str(stories_dir), "--chat", "Hi")
    assert (done.returncode, done.stdout) == (2, "")
    assert "has no chat template" in done.stderr
    assert not has_chat_template(str(stories_dir))


def test_chat_request_carries_the_messages():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    request = build_request(None, chat=messages, max_tokens=8, temperature=0.0)
    assert request.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Be brief."), ("user", QUESTION)]
    with pytest.raises(ValueError, match="either a prompt or chat messages"):
        build_request("text", chat=messages)


@pytest.mark.slow  # runs the 135M model in a subprocess
def test_in_process_chat_prints_the_reply_and_stops_at_end_of_turn(smollm2_dir):
    done = run_cli("generate", "--in-process", "--model", str(smollm2_dir), "--temperature", "0",
                   "--max-tokens", "48", "--stats", "--chat", QUESTION)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ANSWER + "\n"
    assert "[8 tokens, finish=eos," in done.stderr


@pytest.mark.slow  # runs the 135M model in a subprocess
def test_chat_markup_in_a_plain_prompt_gets_a_note(smollm2_dir):
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    done = run_cli("generate", "--in-process", "--model", str(smollm2_dir), "--temperature", "0",
                   "--max-tokens", "1", prompt)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the prompt spells <|im_start|>, <|im_end|>; a prompt is plain text" in done.stderr
    assert "Use --chat" in done.stderr


@pytest.fixture(scope="module")
def smollm2_stack(smollm2_dir, tmp_path_factory):
    launcher = Launcher(LaunchConfig(
        model=str(smollm2_dir), public_port=0, log_dir=str(tmp_path_factory.mktemp("chat_stack_logs")),
        executor_args=["--dtype=fp32", "--device=cpu", "--max-model-len=1024", "--num-blocks=128"],
        start_timeout_s=180, env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}))
    launcher.start()
    yield launcher
    launcher.stop()


@pytest.mark.slow  # starts the four services with the 135M model
def test_chat_over_the_api(smollm2_stack, smollm2_dir):
    done = run_cli("generate", "--address", smollm2_stack.public_address, "--temperature", "0",
                   "--max-tokens", "48", "--chat", QUESTION)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ANSWER + "\n"
    assert "finish=eos" in done.stderr

    # tokenmill up's demo: the model has a chat template, so the demo is one chat turn.
    assert has_chat_template(str(smollm2_dir))
    echo, request = demo_request(True, "Once upon a time", QUESTION)
    out = io.StringIO()
    finished = stream_to_terminal(smollm2_stack.public_address, request, out=out)
    assert (echo, out.getvalue()) == (f"user: {QUESTION}\nassistant: ", ANSWER + "\n")
    assert finished.finish_reason == common_pb2.FINISH_REASON_EOS
