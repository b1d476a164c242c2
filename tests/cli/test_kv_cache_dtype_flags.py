"""--kv-cache-dtype wherever a user gives it: the executor's config (checked values), `tokenmill up`
(passed to the executor) and `tokenmill generate --in-process` (the engine's cache)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.cli.up import parse_up_config, executor_args
from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.inprocess.engine import Engine, EngineConfig
from tests.conftest import REPO_ROOT
from tests.helpers.engine_runs import generate_all


def test_config_names_the_allowed_values():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, got 'int4'"):
        ExecutorConfig(model="m", kv_cache_dtype="int4").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs compile off"):
        ExecutorConfig(model="m", kv_cache_dtype="int8", compiled_decode=CompiledDecodeSettings(compile=True)).validate()
    ExecutorConfig(model="m", kv_cache_dtype="fp8_e4m3").validate()


def test_up_passes_it_to_the_executor(capsys):
    args = parse_up_config(["--kv-cache-dtype", "int8", "--executor-arg=--block-size=32"])
    assert executor_args(args) == ["--kv-cache-dtype=int8", "--block-size=32"]
    assert executor_args(parse_up_config([])) == []
    with pytest.raises(SystemExit):
        parse_up_config(["--kv-cache-dtype", "int4"])
    assert "kv_cache_dtype must be one of auto, int8, fp8_e4m3, got 'int4'" in capsys.readouterr().err


@pytest.mark.slow  # a subprocess that imports torch and loads the model
def test_generate_in_process_uses_the_quantized_cache(stories_dir):
    # a prompt whose greedy text with an int8 cache departs from the fp32 cache's within a few
    # tokens (docs/design.md), so the output shows which cache ran
    prompt, max_tokens = "The little dog wanted", 16
    command = [sys.executable, "-m", "services.cli.main", "generate", "--in-process", "--model", str(stories_dir),
               "--temperature", "0", "--max-tokens", str(max_tokens), "--ignore-eos", "--kv-cache-dtype", "int8",
               prompt]
    done = subprocess.run(command, cwd=REPO_ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    texts = {}
    for kv_cache_dtype in ("int8", "auto"):
        engine = Engine(EngineConfig(ExecutorConfig(model=str(stories_dir), kv_cache_dtype=kv_cache_dtype)))
        (out,) = generate_all(engine, [prompt], SamplingParams(temperature=0.0),
                                     StopConditions(max_tokens=max_tokens, ignore_eos=True))
        texts[kv_cache_dtype] = prompt + out.text + "\n"
    assert texts["int8"] != texts["auto"], "the prompt no longer tells the caches apart; pick another"
    assert done.stdout == texts["int8"]
