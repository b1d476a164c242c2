"""Warm-up before SERVING: it runs, leaves the runner empty, is logged with its duration, and
changes nothing a request then gets (greedy, seeded and unseeded random sampling alike)."""

from __future__ import annotations

import pytest
import structlog

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve
from services.executor.model_runner import ModelRunner
from services.executor.warmup import compile_cache_dirs, warm_up
from tests.conftest import STORIES_DIR

PROMPTS = [[1, 403, 407, 261, 378], [1, 365, 263, 471, 300, 299, 402], [1, 310]]
SAMPLINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),  # unseeded: the shared generator
             SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)]
NEW_TOKENS = 20


def runner(**overrides) -> ModelRunner:
    values = dict(model=str(STORIES_DIR), dtype="fp32", device="cpu", attention_backend="cpu", num_blocks=64, seed=0)
    return ModelRunner(ExecutorConfig(**{**values, **overrides}))


def generate(r: ModelRunner) -> list[list[int]]:
    """Three requests in one batch, as a scheduler would send them, 20 tokens each."""
    blocks = [[4 * i + j for j in range(4)] for i in range(len(PROMPTS))]  # 64 slots each
    new = [NewSequence(i, p, len(p), 0, len(p), blocks[i], s) for i, (p, s) in enumerate(zip(PROMPTS, SAMPLINGS))]
    outputs = [o.token_ids for o in r.execute(StepPlan(0, new=new)).outputs]
    for step in range(1, NEW_TOKENS):
        result = r.execute(StepPlan(step, running=[RunningSequence(i, 1) for i in range(len(PROMPTS))]))
        for tokens, out in zip(outputs, result.outputs):
            tokens += out.token_ids
    return outputs


def test_warm_up_runs_the_steps_and_leaves_no_sequence():
    r = runner()
    report = warm_up(r)
    assert r.sequences == {}
    assert report.steps == 8  # seven steps and the one that forgets the scratch sequences
    assert report.seconds > 0 and report.kernel_launches == 0  # the cpu backend has no kernel buckets


def test_first_requests_after_warm_up_equal_those_without():
    warmed = runner()
    warm_up(warmed)
    assert generate(warmed) == generate(runner())


def test_warm_up_in_a_pool_too_small_for_it_warms_what_fits():
    r = runner(num_blocks=2, block_size=4)
    report = warm_up(r)
    assert r.sequences == {} and 1 < report.steps < 8


def test_warm_up_refuses_a_runner_that_holds_sequences():
    r = runner()
    r.execute(StepPlan(0, new=[NewSequence(0, PROMPTS[0], 5, 0, 5, [0], SAMPLINGS[0])]))
    with pytest.raises(ValueError, match="warm-up needs an idle runner"):
        warm_up(r)


@pytest.mark.parametrize("skip", [False, True])
async def test_executor_logs_its_warm_up_before_serving(skip):
    config = ExecutorServiceConfig(port=0, skip_warmup=skip, executor=ExecutorConfig(
        model=str(STORIES_DIR), dtype="fp32", device="cpu", num_blocks=64))
    with structlog.testing.capture_logs() as logs:
        running = await serve(config)
    await running.stop(grace=0)
    events = [entry["event"] for entry in logs]
    if skip:
        assert "warmup_skipped" in events and "warmup_done" not in events
    else:
        (done,) = [entry for entry in logs if entry["event"] == "warmup_done"]
        assert done["seconds"] > 0 and done["steps"] == 8
        assert "triton_cache_dir" in done and "torchinductor_cache_dir" in done


def test_compile_caches_default_to_one_stable_folder_and_keep_a_choice(tmp_path):
    env = {"TOKENMILL_CACHE_DIR": str(tmp_path)}
    assert compile_cache_dirs(env) == {"TRITON_CACHE_DIR": str(tmp_path / "triton"),
                                       "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    chosen = {"TRITON_CACHE_DIR": "/somewhere/triton"}
    assert compile_cache_dirs(chosen)["TRITON_CACHE_DIR"] == "/somewhere/triton"
    assert chosen["TORCHINDUCTOR_CACHE_DIR"].endswith("/.cache/tokenmill/inductor")


def test_warm_up_gives_each_kv_group_its_blocks(tmp_path):
    """Gemma 3's window and global layers keep blocks of their own (services/common/kv_groups.py):
    the scratch sequences' tables hold a block of each group per block_size tokens (once they
    held one, and the first step's slots ran off the table)."""
    from services.tools.random_model import build_random_model
    from tests.helpers.family_specs import FAMILY_SPECS

    model_dir = build_random_model(FAMILY_SPECS["gemma3"], tmp_path / "gemma3")
    r = runner(model=str(model_dir))
    assert r.kv_groups.num_groups == 3
    report = warm_up(r)
    assert r.sequences == {} and report.steps == 8
