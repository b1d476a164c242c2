"""Sliding-window KV memory through the engine: Gemma 3's local layers give their blocks back as
the window passes (services/common/kv_groups.py), and generation stays transformers' greedy
text through chunked prompts, a pool so small that requests are preempted and given-back
blocks reused by others, and prefix-cache hits on prompts whose local blocks were given back."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.request.stop import StopConditions
from services.tools.random_model import build_random_model
from tests.helpers.family_specs import FAMILY_SPECS
from tests.helpers.paged_forward import hf_greedy

transformers = pytest.importorskip("transformers")

BLOCK = 4
WINDOW = FAMILY_SPECS["gemma3"].sliding_window  # 16
NEW = 16
CHUNK = 24


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model_dir = build_random_model(FAMILY_SPECS["gemma3"], tmp_path_factory.mktemp("window_kv") / "gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, hf


def make_engine(model_dir, num_blocks: int) -> Engine:
    return Engine(EngineConfig(
        ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK, num_blocks=num_blocks,
                       max_model_len=80),
        limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=CHUNK)))


def poison_free_blocks(engine: Engine) -> None:
    """NaN into every block no request holds and no prefix names: a step that read one (a
    block given back too early, a hit's placeholder) would sample from NaN logits."""
    manager = engine.scheduler.block_manager
    ids = torch.tensor([b.block_id for b in manager.pool.blocks if not b.ref_count and b.block_hash is None],
                       dtype=torch.long)
    for k, v in engine.runner.kv_cache.slots:
        k[ids] = float("nan")
        v[ids] = float("nan")


def run(engine: Engine, prompts, new_tokens: int = NEW) -> list[list[int]]:
    """Greedy ids of ``prompts`` run together, free blocks poisoned before every step."""
    ids = [engine.add_request(p, SamplingParams(temperature=0.0), StopConditions(max_tokens=new_tokens,
                                                                               ignore_eos=True)) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        poison_free_blocks(engine)
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    return [out[i] for i in ids]


def test_local_layers_hold_the_window_and_generation_stays_exact(gemma3):
    model_dir, hf = gemma3
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (41, 30, 47)]
    refs = [hf_greedy(hf, torch.tensor(p), NEW) for p in prompts]
    # 3 KV groups (global layers 2 and 5; local 0, 1 and 3, 4): the three sequences hold 43
    # full-group blocks and about 10 local ones each; 64 do not hold them at once.
    engine = make_engine(model_dir, 64)
    try:
        manager = engine.scheduler.block_manager
        assert manager.windows.group_windows == (0, WINDOW, WINDOW)
        # Twice alone: the second is a prefix hit of 40 tokens whose local blocks before its last
        # window were given back during the first (its table has placeholders there).
        assert run(engine, prompts[:1]) == refs[:1]
        assert run(engine, prompts[:1]) == refs[:1]
        assert manager.prefixes.hits == 40
        # All three at once: preempted, their given-back blocks reused by the others.
        assert run(engine, prompts) == refs
        assert engine.scheduler.num_preemptions > 0
        assert manager.pool.num_free == manager.num_blocks
    finally:
        engine.close()
    # Without the prefix cache every given-back block is poisoned before the next step.
    engine = Engine(EngineConfig(
        ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK, num_blocks=64,
                       max_model_len=80),
        limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=CHUNK, enable_prefix_caching=False)))
    try:
        manager = engine.scheduler.block_manager
        assert run(engine, prompts[1:]) == refs[1:]
        # One long request alone: its local groups never hold more than the window and a chunk.
        prompt = torch.randint(3, 200, (60,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0.0), StopConditions(max_tokens=8, ignore_eos=True),
                           request_id="long")
        most_local = 0
        while engine.has_unfinished():
            engine.step()
            request = engine.scheduler.requests.get("long")
            if request is not None and request.block_ids:
                rows = len(request.block_ids) // 3
                held = sum(1 for b in manager.pool.blocks if b.ref_count)
                most_local = max(most_local, held - rows)
        bound = 2 * (-(-(WINDOW - 1) // BLOCK) + 1 + CHUNK // BLOCK)
        assert 0 < most_local <= bound < 2 * (68 // BLOCK)
    finally:
        engine.close()
