"""``tokenmill generate --in-process`` prints the prompt and its exact greedy continuation.

The command runs as a subprocess (``python -m services.cli.main``, which works before the
package is installed), the way a user runs it, and stdout is compared character for character.

stories260K never generates its EOS token (llama2.c's training data separates stories with
BOS), so --ignore-eos is checked on a copy whose generation_config.json also lists BOS as an
end token: at the end of a story generation stops there (checked in-process, which is cheaper
than another subprocess), unless --ignore-eos is given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.conftest import REPO_ROOT
from tests.helpers.engine_runs import generate_all

# slow: each test runs `tokenmill generate` as a subprocess
pytestmark = pytest.mark.slow

# A story that ends 21 tokens later (greedy): the model then emits BOS to start another.
STORY_END_PROMPT = (
    " ".join(["He did not know what to do."] * 3)
    + "\nTom and his boy went to the box. They saw a big box. They wanted to play with the box. "
    + " ".join(["They did not want to play with the box."] * 3)
    + "\nThey played together. "
    + " ".join(["They had a lot of fun."] * 5)
)
STORY_END = " They liked to play with the box. They had a lot of fun."


def generate_command(model: Path, prompt: str | None, max_tokens: int, *flags: str) -> list[str]:
    command = [sys.executable, "-m", "services.cli.main", "generate", "--in-process", "--model", str(model),
               "--temperature", "0", "--max-tokens", str(max_tokens), *flags]
    return command + ([prompt] if prompt is not None else [])


def run(command: list[str]) -> str:
    # One torch thread each: the commands run side by side, and on a small shared machine
    # threads waiting for each other at every op make a run many times slower.
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command[3:]} exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def bos_ends(stories_dir, tmp_path_factory) -> Path:
    """stories260K with BOS (1) listed beside EOS (2) as an end token."""
    model = tmp_path_factory.mktemp("bos_ends") / "stories260K"
    shutil.copytree(stories_dir, model)
    config_path = model / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [2, 1]
    config_path.write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def outputs(stories_dir, bos_ends) -> dict[str, str]:
    """Every command of this module, run side by side (each spends seconds importing torch)."""
    commands = {
        "prompt": generate_command(stories_dir, "Once upon a time", 20),
        "bos": generate_command(stories_dir, None, 20),
        "story_end_ignore_eos": generate_command(bos_ends, STORY_END_PROMPT, 32, "--ignore-eos"),
    }
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return dict(zip(commands, pool.map(run, commands.values())))


def test_greedy_continuation_of_a_prompt(outputs):
    assert outputs["prompt"] == "Once upon a time, there was a little girl named Lily. She loved to play outsid\n"


def test_no_prompt_starts_from_bos(outputs):
    assert outputs["bos"] == "Once upon a time, there was a little girl named Lily. She loved to play\n"


def test_generation_stops_at_an_end_token(bos_ends):
    engine = Engine(EngineConfig(ExecutorConfig(model=str(bos_ends), device="cpu", num_blocks=64)))
    assert engine.eos_token_ids == (2, 1)
    (out,) = generate_all(engine, [STORY_END_PROMPT], SamplingParams(temperature=0.0), StopConditions(max_tokens=32))
    assert (out.text, out.finish_reason, out.token_ids[-1]) == (STORY_END, "eos", 1)


def test_ignore_eos_continues_past_the_end_token(outputs):
    # The BOS token itself decodes to nothing; the next story follows at once.
    expected = STORY_END_PROMPT + STORY_END + " Once upon a time, there was a little gir\n"
    assert outputs["story_end_ignore_eos"] == expected
