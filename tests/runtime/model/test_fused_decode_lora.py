"""LoRA adapters inside the fused CPU step (services/runtime/model/fused_decode.py) against the
eager forward with the same adapters (llama.py, which calls the batched kernel per projection).

Adapters of ranks 1, 8 and 64 (stacked at max rank 64, so the smaller ones are zero-padded),
targeting all seven modules, q/v alone, the MLP alone, and k/o alone, in one step with rows of
the base model between them; decode steps and steps with prompt, chunk and draft-sized rows;
plain fp32 models (GQA, MQA, q|k|v biases) and a Q4_1 base. Rows without an adapter must come
out bit for bit as the step without adapters gives them, and rows with one must move (a step
that ignored the adapters would fail).
"""

from __future__ import annotations

import pytest
import torch

from services.runtime.lora.adapter import LoraAdapter, module_shapes
from services.runtime.lora.batch import LoraBatch
from services.runtime.lora.stacks import LoraStacks
from services.tools.quantize import quantize_model
from tests.helpers.forward_paths import fused_decode
from tests.helpers.lora_adapters import ALL_TARGETS
from tests.runtime.model.test_fused_decode import CONTEXTS, MIXED, fill_pool, make_runner, model_dir, step_inputs

MAX_RANK = 64
ADAPTERS = [(1, ALL_TARGETS), (8, ("q_proj", "v_proj")), (64, ("gate_proj", "up_proj", "down_proj")),
            (8, ("k_proj", "o_proj"))]
"""(rank, target modules) of the adapter in each slot."""


def random_adapters(config, seed: int) -> list[LoraAdapter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    adapters = []
    for slot, (rank, targets) in enumerate(ADAPTERS):
        weights = {}
        for layer in range(config.num_layers):
            for module in targets:
                out_features, in_features = shapes[module]
                weights[(layer, module)] = (torch.randn(rank, in_features, generator=gen) / in_features**0.5,
                                            torch.randn(out_features, rank, generator=gen) * 0.3)
        adapters.append(LoraAdapter(f"a{slot}", None, rank, 2.0 * rank, 2.0 / rank**0.5, targets, f"{slot}", weights))
    return adapters


def stacks_for(runner, seed: int = 0) -> LoraStacks:
    stacks = LoraStacks(runner.model_config, len(ADAPTERS), MAX_RANK, runner.device)
    for slot, adapter in enumerate(random_adapters(runner.model_config, seed)):
        stacks.write(slot, adapter)
    return stacks


def row_slots(query_lens: list[int], pattern: str) -> torch.Tensor:
    """Each sequence's slot, repeated over its new tokens (LoraBatch.for_rows)."""
    if pattern == "mixed":  # every slot and the base, interleaved
        slots = [(row * 3) % (len(ADAPTERS) + 1) - 1 for row in range(len(query_lens))]
    elif pattern == "one_adapter":
        slots = [2] * len(query_lens)
    else:  # "no_adapter": a batch handed adapters that no row uses
        slots = [-1] * len(query_lens)
    return torch.tensor([slot for slot, n in zip(slots, query_lens) for _ in range(n)], dtype=torch.int32)


def check_step(runner, contexts: list[int], query_lens: list[int], pattern: str, tolerance: float) -> None:
    fused = fused_decode(runner)
    stacks = stacks_for(runner)
    tables, (ids, positions, meta, _) = step_inputs(runner, contexts, query_lens, seed=11)
    assert fused.takes(meta)
    slots = row_slots(query_lens, pattern)
    lora = LoraBatch(stacks, slots)
    caches = runner.kv_cache.layers
    fill_pool(runner, tables, contexts, seed=12)
    with torch.inference_mode():
        base = fused(ids, positions, caches, meta).clone()
        got = fused(ids, positions, caches, meta, lora).clone()
        want = runner.model(ids, positions, caches, meta, lora)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    plain = slots < 0
    assert torch.equal(got[plain], base[plain]), "a row without an adapter changed"
    if (~plain).any():
        moved = (got[~plain] - base[~plain]).abs().amax(dim=1)
        assert (moved > 50 * tolerance).all(), f"adapter rows barely moved: {moved.min():.2e}"


STEPS = {"decode": (CONTEXTS, [1] * len(CONTEXTS)), "prompt_chunk_draft": ([n for n, _ in MIXED], [q for _, q in MIXED])}


@pytest.mark.parametrize("pattern", ["mixed", "one_adapter", "no_adapter"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("name", ["stories260K", "llama-gqa-8-2", "llama-mqa", "qwen2-bias"])
def test_fused_step_with_adapters_equals_the_eager_forward(name, step, pattern, random_model_dirs):
    runner = make_runner(model_dir(name, random_model_dirs))
    check_step(runner, *STEPS[step], pattern, tolerance=1e-4)


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_a_quantized_base_with_adapters_runs_fused_as_it_runs_eagerly(activations, random_model_dirs,
                                                                      tmp_path_factory):
    quantized = tmp_path_factory.mktemp("lora_quantized") / "q4_1"
    quantize_model(model_dir("llama-gqa-8-2", random_model_dirs), quantized, "q4_1")
    runner = make_runner(quantized, quant_activations=activations)
    assert fused_decode(runner).quantized
    # The adapters are fp32 on top of the same quantized kernels; with int8 activations a last-bit
    # difference between the paths may round an activation to the neighbouring code
    # (test_fused_decode.py), so that run is held to int8's rounding instead of fp32's.
    check_step(runner, *STEPS["decode"], "mixed", tolerance=1e-4 if activations == "none" else 2e-2)


def test_a_rows_result_with_an_adapter_does_not_depend_on_its_batch():
    from tests.conftest import STORIES_DIR
    from tests.runtime.model.test_fused_decode import BLOCK_SIZE
    from services.runtime.step_inputs import pack_step_inputs

    runner = make_runner(STORIES_DIR)
    fused = fused_decode(runner)
    stacks = stacks_for(runner, seed=3)
    tables, (ids, positions, meta, _) = step_inputs(runner, CONTEXTS, [1] * len(CONTEXTS), seed=3)
    fill_pool(runner, tables, CONTEXTS, seed=4)
    slots = row_slots([1] * len(CONTEXTS), "mixed")
    with torch.inference_mode():
        batch = fused(ids, positions, runner.kv_cache.layers, meta, LoraBatch(stacks, slots)).clone()
        for row, n in enumerate(CONTEXTS):
            one = pack_step_inputs([int(ids[row])], [n - 1], [int(meta.slot_mapping[row])], [1], [n],
                                   [tables[row]], BLOCK_SIZE, runner.device)
            alone = fused(one[0], one[1], runner.kv_cache.layers, one[2], LoraBatch(stacks, slots[row:row + 1]))
            assert torch.equal(alone[0], batch[row]), f"row {row} (slot {int(slots[row])}) changed with the batch"


def test_a_slot_written_after_the_first_step_is_read_in_place():
    """The registry loads adapters into slots between steps: the decoder reads the stacks it was
    handed, so a slot rewritten later serves its new adapter without a new handle."""
    from tests.conftest import STORIES_DIR

    runner = make_runner(STORIES_DIR)
    fused = fused_decode(runner)
    stacks = LoraStacks(runner.model_config, len(ADAPTERS), MAX_RANK, runner.device)
    tables, (ids, positions, meta, _) = step_inputs(runner, CONTEXTS, [1] * len(CONTEXTS), seed=5)
    slots = torch.full((len(CONTEXTS),), 1, dtype=torch.int32)
    lora = LoraBatch(stacks, slots)
    caches = runner.kv_cache.layers
    with torch.inference_mode():
        fill_pool(runner, tables, CONTEXTS, seed=6)
        empty = fused(ids, positions, caches, meta, lora).clone()  # slot 1 holds zeros
        fill_pool(runner, tables, CONTEXTS, seed=6)
        base = fused(ids, positions, caches, meta).clone()
        assert torch.equal(empty, base)
        stacks.write(1, random_adapters(runner.model_config, seed=7)[1])
        fill_pool(runner, tables, CONTEXTS, seed=6)
        got = fused(ids, positions, caches, meta, lora).clone()
        fill_pool(runner, tables, CONTEXTS, seed=6)
        want = runner.model(ids, positions, caches, meta, lora)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, base)

