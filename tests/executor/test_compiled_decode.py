"""``--compile`` on a CPU: decode steps through the torch.compile'd forward give the eager
runner's greedy tokens over a varlen batch whose size and block-table width change every few
steps, and after the warm-up no step compiles again."""

from __future__ import annotations

import pytest
import torch

from services.executor.config import ExecutorConfig
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.executor.model_runner import ModelRunner
from services.executor.warmup import warm_up
from tests.conftest import STORIES_DIR
from tests.helpers.scripted_requests import run_requests

pytestmark = pytest.mark.slow  # compiling the decode step's graphs takes tens of seconds

BLOCK_SIZE = 16


def make_runner(**overrides) -> ModelRunner:
    values = dict(model=str(STORIES_DIR), dtype="fp32", device="cpu", attention_backend="cpu",
                  block_size=BLOCK_SIZE, num_blocks=64)
    return ModelRunner(ExecutorConfig(**{**values, **overrides}))


def test_compiled_decode_gives_the_eager_tokens_and_never_recompiles_after_warm_up():
    compiled = make_runner(compiled_decode=CompiledDecodeSettings(compile=True))
    warm_up(compiled)
    with torch.compiler.set_stance("fail_on_recompile"):
        got = run_requests(compiled)
    assert got == run_requests(make_runner())
    assert compiled.sequences == {}


def test_compile_is_refused_off_the_cpu_backend():
    with pytest.raises(ValueError, match="compile runs on the CPU with the cpu attention backend"):
        ExecutorConfig(model=str(STORIES_DIR), attention_backend="torch",
                       compiled_decode=CompiledDecodeSettings(compile=True)).validate()
