"""A weight-quantized model served by `tokenmill up`'s four processes.

stories260K quantized to int4 (`tokenmill quantize`: q4_1 projections) runs in the executor
process with two intra-op threads, under the runner's inference mode: a prompt of 16+ tokens
takes the quantized panel path, a short one and every decode step the per-row kernel. The
streams must equal the in-process engine's on the same directory. (The panels' threads and
inference mode are tested on a weight wide enough to split, tests/runtime/model/test_quant.py.)
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from services.stack.launcher import Launcher
from services.tools.quantize import quantize_model
from tests.helpers.launched_stack import generation_stub, in_process_greedy, launched_stack
from tests.helpers.service_harness import STORIES_DIR
from tests.helpers.stack_streams import greedy_request, record_stream

# slow: starts the four services as processes
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

EXECUTOR = dict(dtype="fp32", device="cpu", block_size=16, num_blocks=128)
PROMPTS = ["Once upon a time",
           "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("stories-int4") / "model"
    quantize_model(STORIES_DIR, out, "int4")
    return out


@pytest.fixture(scope="module")
def launcher(tmp_path_factory, model_dir) -> Launcher:
    with launched_stack(model_dir, tmp_path_factory.mktemp("quant_logs"), executor=EXECUTOR, omp_threads=2) as launcher:
        yield launcher


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(launcher: Launcher):
    async with generation_stub(launcher) as stub:
        yield stub


async def test_quantized_streams_equal_the_in_process_engine(stub, model_dir):
    records = await asyncio.gather(*(record_stream(stub, greedy_request(p, MAX_TOKENS)) for p in PROMPTS))
    engine, expected = in_process_greedy(model_dir, EXECUTOR, PROMPTS, MAX_TOKENS)
    assert any(len(engine.encode_prompt(p)) >= 16 for p in PROMPTS), "a prompt must take the panel path"
    assert [r.token_ids for r in records] == expected
    assert all(len(r.token_ids) == MAX_TOKENS for r in records)
