"""The fused CPU step (services/runtime/model/fused_decode.py) against the eager forward.

The eager model (llama.py) is the reference: same inputs, same pool, hidden states within fp32
rounding, over GQA, MQA, q|k|v biases, head dims 8/16/32, plain and quantized pools, batches and
contexts with ragged edges (1, 15, 16, 17, ... slots), decode steps and steps with prompt,
chunk and draft-sized rows, and slots no sequence owns poisoned with NaN. A row's result must not depend on the batch around it, and a serving run must give the
eager runner's greedy tokens. Quantized weights (q4_0, q4_1, q8_0, a tied q8_0 head) run through
the same kernels fused and eager, with exact and with int8 activations.
"""

from __future__ import annotations

import pytest
import torch

from services.executor.config import ExecutorConfig
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.model_runner import ModelRunner
from services.runtime.kernels.kv_quant import ScaledCache
from services.runtime.model.fused_decode import FusedDecode, why_not
from services.runtime.model.quant.linear import QuantLinear
from services.runtime.step_inputs import pack_rows, pack_step_inputs
from services.tools.quantize import quantize_model
from tests.conftest import STORIES_DIR
from tests.helpers.forward_paths import fused_decode
from tests.helpers.scripted_requests import REQUESTS, run_requests

BLOCK_SIZE = 16
CONTEXTS = [1, 15, 16, 17, 33, 100, 2, 64, 5]  # slots each sequence holds after this step's token


def make_runner(model_dir, **overrides) -> ModelRunner:
    values = dict(model=str(model_dir), dtype="fp32", device="cpu", attention_backend="cpu",
                  block_size=BLOCK_SIZE, num_blocks=96)
    return ModelRunner(ExecutorConfig(**{**values, **overrides}))


def model_dir(name: str, random_model_dirs):
    return STORIES_DIR if name == "stories260K" else random_model_dirs[name]


def fill_pool(runner: ModelRunner, tables: list[list[int]], contexts: list[int], seed: int) -> None:
    """Random K/V in every slot a sequence owns; NaN wherever no sequence does (a kernel that
    reads a slot it must not would carry the NaN into its output)."""
    gen = torch.Generator().manual_seed(seed)
    owned = torch.zeros(runner.num_usable_blocks * BLOCK_SIZE, dtype=torch.bool)
    for table, n in zip(tables, contexts):
        for p in range(n):
            owned[table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] = True
    for k_cache, v_cache in runner.kv_cache.layers:
        for cache in (k_cache, v_cache):
            if isinstance(cache, ScaledCache):
                flat = cache.data.view(-1, *cache.data.shape[2:])
                values = torch.randn(flat.shape, generator=gen) * 40
                flat.copy_(values.clamp(-127, 127).round().to(flat.dtype) if flat.dtype == torch.int8
                           else values.to(flat.dtype))
                scale = cache.scale.view(-1, cache.scale.shape[-1])
                scale.copy_((torch.rand(scale.shape, generator=gen) * 0.02 + 0.005).half())
                scale[~owned] = float("nan")
            else:
                flat = cache.view(-1, *cache.shape[2:])
                flat.copy_(torch.randn(flat.shape, generator=gen))
                flat[~owned] = float("nan")


def decode_inputs(runner: ModelRunner, contexts: list[int], seed: int):
    return step_inputs(runner, contexts, [1] * len(contexts), seed)


def step_inputs(runner: ModelRunner, contexts: list[int], query_lens: list[int], seed: int):
    """A step whose sequence i computes its last query_lens[i] of contexts[i] tokens (the rest
    cached): tables of out-of-order blocks, random token ids."""
    gen = torch.Generator().manual_seed(seed)
    tables, next_block = [], 0
    for n in contexts:
        width = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + width))[::-1])  # blocks out of order
        next_block += width
    ids = torch.randint(0, runner.model_config.vocab_size, (sum(query_lens),), generator=gen).tolist()
    positions = [p for n, q in zip(contexts, query_lens) for p in range(n - q, n)]
    row_tables = [t for t, q in zip(tables, query_lens) for _ in range(q)]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(row_tables, positions)]
    return tables, pack_step_inputs(ids, positions, slots, query_lens, contexts, tables, BLOCK_SIZE, runner.device)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("name", ["stories260K", "llama-gqa-8-2", "llama-mqa", "qwen2-bias"])
def test_fused_step_equals_the_eager_forward(name, kv_cache_dtype, random_model_dirs):
    runner = make_runner(model_dir(name, random_model_dirs), kv_cache_dtype=kv_cache_dtype)
    assert fused_decode(runner) is not None
    tables, (ids, positions, meta, _) = decode_inputs(runner, CONTEXTS, seed=1)
    fill_pool(runner, tables, CONTEXTS, seed=2)
    caches = runner.kv_cache.layers
    quantized = isinstance(caches[0][0], ScaledCache)
    with torch.inference_mode():
        fused = fused_decode(runner)(ids, positions, caches, meta)
        written = [tuple(step_rows(c, meta.slot_mapping) for c in layer) for layer in caches]
        eager = runner.model(ids, positions, caches, meta)
    assert fused.shape == eager.shape == (len(CONTEXTS), runner.model_config.hidden_size)
    assert torch.isfinite(fused).all()
    for layer, rows in zip(caches, written):
        for cache, (values, scales) in zip(layer, rows):
            want_values, want_scales = step_rows(cache, meta.slot_mapping)
            if quantized:
                # Inputs equal to ~1e-6 may round to neighbouring codes: at most one step apart.
                codes = values.view(torch.uint8).int() if values.dtype != torch.int8 else values.int()
                want_codes = want_values.view(torch.uint8).int() if values.dtype != torch.int8 else want_values.int()
                assert (codes - want_codes).abs().max() <= 1
                torch.testing.assert_close(scales.float(), want_scales.float(), rtol=1e-3, atol=0)
            else:
                torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
    # A quantized pool carries those one-step differences of the new token's K/V into the
    # output (at context 1 the output is that V): a looser bound there; plain pools stay tight.
    tolerance = 2e-2 if quantized else 1e-4
    torch.testing.assert_close(fused, eager, rtol=tolerance, atol=tolerance)


# (context after the step, new tokens): whole prompts (1, 5, 16 and 17 tokens, one ending on a
# block edge and one just past it), chunks and prefix-cache hits continuing cached contexts,
# decode rows and a verification-sized row, all in one step of 60 tokens.
MIXED = [(5, 5), (33, 1), (29, 12), (16, 16), (1, 1), (100, 4), (17, 17), (64, 1), (40, 3)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("name", ["stories260K", "llama-gqa-8-2", "llama-mqa", "qwen2-bias"])
def test_a_step_with_prompt_tokens_equals_the_eager_forward(name, kv_cache_dtype, random_model_dirs):
    runner = make_runner(model_dir(name, random_model_dirs), kv_cache_dtype=kv_cache_dtype)
    contexts, query_lens = [n for n, _ in MIXED], [q for _, q in MIXED]
    tables, (ids, positions, meta, _) = step_inputs(runner, contexts, query_lens, seed=5)
    assert not meta.is_decode_only and fused_decode(runner).takes(meta)
    fill_pool(runner, tables, contexts, seed=6)
    caches = runner.kv_cache.layers
    with torch.inference_mode():
        fused = fused_decode(runner)(ids, positions, caches, meta)
        eager = runner.model(ids, positions, caches, meta)
    assert fused.shape == eager.shape == (sum(query_lens), runner.model_config.hidden_size)
    assert torch.isfinite(fused).all()
    # Every row, not only the last of each sequence: a verification step samples from all of them.
    tolerance = 2e-2 if kv_cache_dtype != "auto" else 1e-4
    torch.testing.assert_close(fused, eager, rtol=tolerance, atol=tolerance)


def test_steps_over_the_token_limit_run_eagerly():
    runner = make_runner(STORIES_DIR, fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=16))
    fused = fused_decode(runner)
    assert fused.takes(step_inputs(runner, [16, 3], [15, 1], seed=0)[1][2])
    assert not fused.takes(step_inputs(runner, [16, 3], [16, 1], seed=0)[1][2])
    assert fused.takes(decode_inputs(runner, list(range(1, 40)), seed=0)[1][2]), "decode steps have no limit"
    off = fused_decode(make_runner(STORIES_DIR, fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=0)))
    assert not off.takes(step_inputs(runner, [2], [2], seed=0)[1][2])
    with pytest.raises(ValueError, match="cpu_fused_max_tokens must be >= 0"):
        ExecutorConfig(model=str(STORIES_DIR), fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=-1)).validate()


def step_rows(cache, slot_mapping: torch.Tensor):
    """(values, scales or None) the step's slots hold in ``cache``, copied."""
    if isinstance(cache, ScaledCache):
        values = cache.data.view(-1, *cache.data.shape[2:])[slot_mapping].clone()
        return values, cache.scale.view(-1, cache.scale.shape[-1])[slot_mapping].clone()
    return cache.view(-1, *cache.shape[2:])[slot_mapping].clone(), None


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_its_batch(threads):
    runner = make_runner(STORIES_DIR)
    tables, (ids, positions, meta, _) = decode_inputs(runner, CONTEXTS, seed=3)
    fill_pool(runner, tables, CONTEXTS, seed=4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            batch = fused_decode(runner)(ids, positions, runner.kv_cache.layers, meta)
            for row, n in enumerate(CONTEXTS):
                one = pack_step_inputs([int(ids[row])], [n - 1], [int(meta.slot_mapping[row])], [1], [n],
                                       [tables[row]], BLOCK_SIZE, runner.device)
                alone = fused_decode(runner)(one[0], one[1], runner.kv_cache.layers, one[2])
                assert torch.equal(alone[0], batch[row]), f"row {row} (context {n}) changed with the batch"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name", ["stories260K", "llama-gqa-8-2", "qwen2-bias"])
def test_logits_equal_the_models_lm_head(name, random_model_dirs):
    runner = make_runner(model_dir(name, random_model_dirs))
    fused = fused_decode(runner)
    assert fused.computes_logits
    hidden = torch.randn(9, runner.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(fused.logits(hidden), runner.model.compute_logits(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_logits_do_not_depend_on_its_batch(threads):
    # The eager LM head (BLAS) does not hold this: one or two rows take another kernel.
    runner = make_runner(STORIES_DIR)
    hidden = torch.randn(19, runner.model_config.hidden_size, generator=torch.Generator().manual_seed(1))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            batch = fused_decode(runner).logits(hidden)
            for n in (1, 2, 3, 4, 5, 8, 17):
                assert torch.equal(fused_decode(runner).logits(hidden[:n]), batch[:n]), f"{n} rows"
            assert torch.equal(fused_decode(runner).logits(hidden[7:8])[0], batch[7])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("max_step_tokens", [0, 8, 256])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_serving_gives_the_eager_runners_greedy_tokens(kv_cache_dtype, max_step_tokens):
    # The scripted prompts (1-40 tokens, arriving into decode steps) run fused or eagerly by size.
    fused = make_runner(STORIES_DIR, kv_cache_dtype=kv_cache_dtype,
                        fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=max_step_tokens))
    eager = make_runner(STORIES_DIR, kv_cache_dtype=kv_cache_dtype, fused_decode=FusedDecodeSettings(cpu_decode="eager"))
    assert fused_decode(fused) is not None and fused_decode(eager) is None
    assert run_requests(fused) == run_requests(eager)
    assert fused.sequences == {}


def test_bad_step_inputs_are_errors_not_reads():
    runner = make_runner(STORIES_DIR)
    caches = runner.kv_cache.layers
    ids, positions, meta, _ = pack_step_inputs([runner.model_config.vocab_size], [0], [0], [1], [1], [[0]],
                                               BLOCK_SIZE, runner.device)
    with pytest.raises(RuntimeError, match=r"input_ids\[0\] = 512 is outside the vocabulary of 512"):
        fused_decode(runner)(ids, positions, caches, meta)
    ids, positions, meta, _ = pack_step_inputs([3], [0], [0], [1], [1], [[runner.num_usable_blocks]],
                                               BLOCK_SIZE, runner.device)
    with pytest.raises(ValueError, match="outside the pool"):
        fused_decode(runner)(ids, positions, caches, meta)
    other = make_runner(STORIES_DIR).kv_cache.layers
    with pytest.raises(ValueError, match="KV pools it was built with"):
        fused_decode(runner)(ids, positions, other, meta)


def test_models_it_does_not_fit_keep_the_eager_step(random_model_dirs):
    # Big enough that its products are prepacked for oneDNN: the products dominate, eager wins.
    wide = make_runner(random_model_dirs["llama-wide-prepacked"])
    assert fused_decode(wide) is None
    assert "prepacked" in why_not(wide.model, wide.kv_cache.layers)
    bf16 = make_runner(STORIES_DIR, dtype="bf16")
    assert fused_decode(bf16) is None
    assert "bfloat16" in why_not(bf16.model, bf16.kv_cache.layers)
    torch_backend = make_runner(STORIES_DIR, attention_backend="torch")
    assert fused_decode(torch_backend) is None
    with pytest.raises(ValueError, match="cpu_decode 'fused'.*prepacked"):
        make_runner(random_model_dirs["llama-wide-prepacked"], fused_decode=FusedDecodeSettings(cpu_decode="fused"))
    with pytest.raises(ValueError, match="fused CPU decode step cannot run this model"):
        FusedDecode(bf16.model, bf16.kv_cache.layers)


def test_cpu_decode_flag_is_validated():
    with pytest.raises(ValueError, match="cpu_decode must be one of auto, fused, eager"):
        ExecutorConfig(model=str(STORIES_DIR), fused_decode=FusedDecodeSettings(cpu_decode="fast")).validate()
    with pytest.raises(ValueError, match="cpu_decode 'fused' runs on the CPU without compile"):
        ExecutorConfig(model=str(STORIES_DIR), fused_decode=FusedDecodeSettings(cpu_decode="fused"),
                       compiled_decode=CompiledDecodeSettings(compile=True)).validate()


# (model, --weights): every GGUF format once, q|k|v biases, and a tied q8_0 head (MQA).
QUANTIZED = [("stories260K", "int4"), ("llama-gqa-8-2", "q4_1"), ("llama-mqa", "q8_0"), ("qwen2-bias", "q4_0")]


@pytest.fixture(scope="module")
def quantized_dirs(random_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, weights in QUANTIZED:
        out[name] = root / f"{name}-{weights}"
        quantize_model(model_dir(name, random_model_dirs), out[name], weights)
    return out


@pytest.mark.parametrize("activations", ["none", "int8"])
@pytest.mark.parametrize("name", [n for n, _ in QUANTIZED])
def test_a_quantized_model_runs_fused_as_it_runs_eagerly(name, activations, quantized_dirs):
    runner = make_runner(quantized_dirs[name], quant_activations=activations)
    paths = {m.path for m in runner.model.modules() if isinstance(m, QuantLinear)}
    assert paths == {"cpu_int8" if activations == "int8" else "cpu_kernel"}, paths
    assert fused_decode(runner) is not None and fused_decode(runner).computes_logits
    exact = make_runner(quantized_dirs[name], quant_activations="none",
                        fused_decode=FusedDecodeSettings(cpu_decode="eager"))
    caches = runner.kv_cache.layers
    for contexts, query_lens in ((CONTEXTS, [1] * len(CONTEXTS)), ([n for n, _ in MIXED], [q for _, q in MIXED])):
        tables, (ids, positions, meta, _) = step_inputs(runner, contexts, query_lens, seed=7)
        fill_pool(runner, tables, contexts, seed=8)
        fill_pool(exact, tables, contexts, seed=8)
        with torch.inference_mode():
            fused = fused_decode(runner)(ids, positions, caches, meta)
            eager = runner.model(ids, positions, caches, meta)
            assert torch.isfinite(fused).all()
            torch.testing.assert_close(fused_decode(runner).logits(fused), runner.model.compute_logits(fused),
                                       rtol=1e-5, atol=1e-5)
            if activations == "none":  # the same kernels on inputs equal to fp32 rounding
                torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
                continue
            # With int8 activations, inputs that differ in their last bit round to neighbouring
            # codes when one lies on a .5 boundary, and the row carries that through its layers
            # (1-2 rows in 9 or 60 here): most rows stay within fp32 rounding, and none moves
            # further than int8 rounding itself moves it from the exact path. A wiring mistake
            # (a wrong weight, bias or scale) moves every row.
            reference = exact.model(ids, positions, exact.kv_cache.layers, meta)
        close = ((fused - eager).abs() <= 1e-4 + 1e-4 * eager.abs()).all(dim=1)
        assert close.float().mean() >= 0.75, f"{int((~close).sum())} of {len(close)} rows differ"
        assert (fused - eager).abs().max() <= (eager - reference).abs().max()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_quantized_rows_result_does_not_depend_on_its_batch(threads, quantized_dirs):
    runner = make_runner(quantized_dirs["llama-gqa-8-2"], quant_activations="int8")
    tables, (ids, positions, meta, _) = decode_inputs(runner, CONTEXTS, seed=3)
    fill_pool(runner, tables, CONTEXTS, seed=4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = make_runner(quantized_dirs["llama-gqa-8-2"], quant_activations="int8")  # its pool: `threads`
        fill_pool(runner, tables, CONTEXTS, seed=4)
        with torch.inference_mode():
            batch = fused_decode(runner)(ids, positions, runner.kv_cache.layers, meta)
            logits = fused_decode(runner).logits(batch)
            for row, n in enumerate(CONTEXTS):
                one = pack_step_inputs([int(ids[row])], [n - 1], [int(meta.slot_mapping[row])], [1], [n],
                                       [tables[row]], BLOCK_SIZE, runner.device)
                alone = fused_decode(runner)(one[0], one[1], runner.kv_cache.layers, one[2])
                assert torch.equal(alone[0], batch[row]), f"row {row} (context {n}) changed with the batch"
                assert torch.equal(fused_decode(runner).logits(alone)[0], logits[row])
    finally:
        torch.set_num_threads(previous)


def test_a_quantized_model_serves_the_eager_runners_greedy_tokens(quantized_dirs):
    fused = make_runner(quantized_dirs["stories260K"], quant_activations="none")
    eager = make_runner(quantized_dirs["stories260K"], quant_activations="none",
                        fused_decode=FusedDecodeSettings(cpu_decode="eager"))
    assert fused_decode(fused) is not None and fused_decode(eager) is None
    assert run_requests(fused) == run_requests(eager)


def test_int8_activations_serve_each_request_as_if_alone(quantized_dirs):
    """Against the eager runner greedy tokens may part where an input lands on a rounding
    boundary; what must hold is that a request's tokens do not depend on the batch it shares
    (every step of the script runs fused, prompts mixed into decode steps included)."""
    runner = make_runner(quantized_dirs["stories260K"], quant_activations="int8")
    together = run_requests(runner)
    for seq_id, (_, prompt_len, tokens) in enumerate(REQUESTS):
        # Alone: the same prompt (run_requests derives it from the sequence id); the others never arrive.
        script = [(10**6, 1, 1)] * seq_id + [(0, prompt_len, tokens)]
        alone = run_requests(make_runner(quantized_dirs["stories260K"], quant_activations="int8"), script)
        assert alone[seq_id] == together[seq_id], f"request {seq_id}"


def test_quant_activations_flag_is_validated():
    with pytest.raises(ValueError, match="quant_activations must be one of auto, int8, none"):
        ExecutorConfig(model=str(STORIES_DIR), quant_activations="int4").validate()
    with pytest.raises(ValueError, match="quant_activations 'int8' runs on the CPU"):
        ExecutorConfig(model=str(STORIES_DIR), quant_activations="int8", device="cuda").validate()
    with pytest.raises(ValueError, match="quant_activations 'int8' runs on one rank"):
        ExecutorConfig(model=str(STORIES_DIR), quant_activations="int8", tensor_parallel_size=2).validate()


def test_a_quantized_model_runs_steps_fused_up_to_eight_times_the_limit(quantized_dirs):
    runner = make_runner(quantized_dirs["llama-gqa-8-2"], num_blocks=200,
                         fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=16))
    fused = fused_decode(runner)
    assert fused.quantized and fused.max_step_tokens == 128
    assert fused.takes(step_inputs(runner, [100, 28], [100, 28], seed=0)[1][2])
    assert not fused.takes(step_inputs(runner, [100, 29], [100, 29], seed=0)[1][2])
    fp32 = make_runner(STORIES_DIR, fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=16))
    assert fused_decode(fp32).max_step_tokens == 16, "fp32: the limit"


# Gemma 3's layer through the fused step: q/k norms, pre- and post-norms, GeGLU, scaled
# embeddings, and local layers with their own window, RoPE base and KV group (the step hands the
# decoder every group's slots and tables); Gemma 2's soft caps on scores and logits (3 and 8, small
# enough to bite); Mistral's window on every layer of a Llama.
WINDOWED = ["gemma3", "gemma3-linear-rope", "gemma2", "mistral-window"]
# (context after the step, new tokens): decode rows at, inside and past the windows (16 and 8
# keys), a whole prompt longer than the window, and a chunk continuing a cached context.
WINDOWED_STEPS = ([(n, 1) for n in (1, 8, 9, 15, 16, 17, 33, 50)], [(20, 20), (5, 1), (40, 7), (17, 1)])


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from services.tools.random_model import build_random_model
    from tests.helpers.family_specs import FAMILY_SPECS

    root = tmp_path_factory.mktemp("fused_families")
    return {name: build_random_model(FAMILY_SPECS[name], root / name) for name in WINDOWED}


def grouped_step_inputs(runner: ModelRunner, contexts: list[int], query_lens: list[int], seed: int):
    """step_inputs for a model with KV groups: each sequence's blocks, shuffled, interleave its
    groups' tables (pack_rows' layout). Returns every group's (table, context) and the step."""
    n = runner.kv_groups.num_groups
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(runner.num_usable_blocks, generator=gen).tolist()
    rows, owned = [], []
    for context, q in zip(contexts, query_lens):
        width = -(-context // BLOCK_SIZE)
        blocks, free = free[: width * n], free[width * n:]
        ids = torch.randint(0, runner.model_config.vocab_size, (q,), generator=gen).tolist()
        rows.append((ids, context - q, blocks))
        owned += [(blocks[k::n], context) for k in range(n)]
    ids, positions, meta, _ = pack_rows(rows, BLOCK_SIZE, runner.device, n)
    return owned, (ids, positions, meta)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_and_gemma_layers_run_fused_as_they_run_eagerly(name, kv_cache_dtype, family_dirs):
    runner = make_runner(family_dirs[name], kv_cache_dtype=kv_cache_dtype, num_blocks=160)
    assert why_not(runner.model, runner.kv_cache.layers) is None
    fused = fused_decode(runner)
    assert fused is not None and fused.computes_logits
    if name.startswith("gemma3"):
        assert runner.kv_groups.num_groups > 1, "local and global layers in KV groups of their own"
    caches = runner.kv_cache.layers
    for seed, step in enumerate(WINDOWED_STEPS):
        contexts, query_lens = [n for n, _ in step], [q for _, q in step]
        owned, (ids, positions, meta) = grouped_step_inputs(runner, contexts, query_lens, seed=seed)
        assert fused.takes(meta)
        fill_pool(runner, [t for t, _ in owned], [n for _, n in owned], seed=seed + 10)
        with torch.inference_mode():
            got = fused(ids, positions, caches, meta)
            eager = runner.model(ids, positions, caches, meta)
            assert got.shape == eager.shape == (sum(query_lens), runner.model_config.hidden_size)
            assert torch.isfinite(got).all()
            tolerance = 2e-2 if kv_cache_dtype != "auto" else 1e-4
            torch.testing.assert_close(got, eager, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(fused.logits(got), runner.model.compute_logits(got), rtol=1e-4, atol=1e-4)


def test_a_k_quant_model_runs_fused_as_it_runs_eagerly(tmp_path):
    """A Q4_K_M-like file kept in its blocks (Q5_0 q, Q5_1 k and Q6_K v stacked side by side, Q4_K,
    Q5_K and Q6_K elsewhere, a Q6_K head): every product on the K-quant kernels with int8
    activations, fused as eagerly, and a row's result independent of its batch."""
    from gguf import GGMLQuantizationType as T

    from services.runtime.model.quant.linear import StackedLinear
    from services.tools.gguf import convert_gguf
    from tests.tools.gguf_helpers import write_tiny_llama_gguf

    source = tmp_path / "mix.gguf"
    write_tiny_llama_gguf(source, untied=True, dims=dict(hidden=256, ffn=512, heads=4, kv_heads=2), qtypes=dict(
        attn_q=T.Q5_0, attn_k=T.Q5_1, attn_v=T.Q6_K, attn_output=T.Q4_K, ffn_gate=T.Q4_K, ffn_up=T.Q5_K,
        ffn_down=T.Q6_K, output=T.Q6_K, token_embd=T.Q4_K))
    convert_gguf(source, tmp_path / "keep", weights="keep")
    runner = make_runner(tmp_path / "keep", quant_activations="auto")
    assert isinstance(runner.model.layers[0].qkv, StackedLinear)
    assert {m.path for m in runner.model.modules() if isinstance(m, QuantLinear)} == {"cpu_kquant"}
    fused = fused_decode(runner)
    assert fused is not None and fused.computes_logits
    caches = runner.kv_cache.layers
    for contexts, query_lens in ((CONTEXTS, [1] * len(CONTEXTS)), ([n for n, _ in MIXED], [q for _, q in MIXED])):
        tables, (ids, positions, meta, _) = step_inputs(runner, contexts, query_lens, seed=7)
        fill_pool(runner, tables, contexts, seed=8)
        with torch.inference_mode():
            got = fused(ids, positions, caches, meta)
            eager = runner.model(ids, positions, caches, meta)
            torch.testing.assert_close(fused.logits(got), runner.model.compute_logits(got), rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got).all()
        # int8 activations: a last-bit difference can round an input to the neighbouring code and
        # move its row (see the quantized test above); a wiring mistake moves every row.
        close = ((got - eager).abs() <= 1e-4 + 1e-4 * eager.abs()).all(dim=1)
        assert close.float().mean() >= 0.75, f"{int((~close).sum())} of {len(close)} rows differ"
    tables, (ids, positions, meta, _) = decode_inputs(runner, CONTEXTS, seed=3)
    fill_pool(runner, tables, CONTEXTS, seed=4)
    with torch.inference_mode():
        batch = fused(ids, positions, caches, meta)
        for row, n in enumerate(CONTEXTS):
            one = pack_step_inputs([int(ids[row])], [n - 1], [int(meta.slot_mapping[row])], [1], [n], [tables[row]],
                                   BLOCK_SIZE, runner.device)
            assert torch.equal(fused(one[0], one[1], caches, one[2])[0], batch[row]), f"row {row} moved"


def test_a_k_quant_models_tied_q8_0_head_takes_int8_activations_by_default(tmp_path, quantized_dirs):
    """Gemma 3 Q4_K_M's mix in small (Q5_0 q, k and gate|up, a Q8_0 v, Q4_K o, Q6_K down, the tied
    Q8_0 embedding as its head): under the default (auto) a model whose layers take int8
    activations takes them at its head too, llama.cpp's arithmetic, where the exact head was most
    of the step. The fused step's logits equal the PyTorch reference of that product over a vocabulary
    of 263 (a partial tile of 16) at 1, 3 and 7 rows on every instruction set, each row's bits
    independent of its batch; ``none`` keeps the exact head; an all-exact model keeps auto exact."""
    from gguf import GGMLQuantizationType as T

    from services.runtime.kernels import cpu
    from services.runtime.kernels.quant_act import int8_matmul_reference
    from services.runtime.model.config import ModelConfig
    from services.runtime.model.weights import load_checkpoint
    from services.tools.gguf import convert_gguf
    from tests.tools.gguf_helpers import write_tiny_llama_gguf

    write_tiny_llama_gguf(tmp_path / "mix.gguf", dims=dict(hidden=256, ffn=512, heads=4, kv_heads=1), qtypes=dict(
        attn_q=T.Q5_0, attn_k=T.Q5_0, attn_v=T.Q8_0, attn_output=T.Q4_K, ffn_gate=T.Q5_0, ffn_up=T.Q5_0,
        ffn_down=T.Q6_K, token_embd=T.Q8_0))
    keep = tmp_path / "keep"
    convert_gguf(tmp_path / "mix.gguf", keep, weights="keep")
    runner = make_runner(keep)  # --quant-activations auto, the default
    assert runner.model.lm_head.path == "cpu_int8"
    assert {m.path for m in runner.model.modules() if isinstance(m, QuantLinear)} == {"cpu_kquant", "cpu_int8"}
    assert make_runner(keep, quant_activations="none").model.lm_head.path == "cpu_kernel"
    assert {m.path for m in make_runner(quantized_dirs["llama-gqa-8-2"]).model.modules()
            if isinstance(m, QuantLinear)} == {"cpu_kernel"}, "q4_1 with a q8_0 head: exact"
    head = load_checkpoint(keep, ModelConfig.from_model_dir(keep), torch.float32)["model.embed_tokens.weight"]
    assert head.fmt == "q8_0" and head.shape == (263, 256)
    fused = fused_decode(runner)
    assert fused is not None and fused.computes_logits
    gen = torch.Generator().manual_seed(5)
    previous = cpu.isa()
    try:
        for isa in cpu.supported_isas():
            cpu.set_isa(isa)
            for rows in (1, 3, 7):
                hidden = torch.randn(rows, 256, generator=gen) * torch.logspace(-2, 1, 256)
                logits = fused.logits(hidden)
                expected = int8_matmul_reference(hidden, head)
                torch.testing.assert_close(logits, expected, atol=2e-6 * expected.abs().max().item(), rtol=1e-5)
                alone = torch.cat([fused.logits(hidden[i:i + 1]) for i in range(rows)])
                assert torch.equal(logits, alone), f"{isa}: a row's logits moved with its batch of {rows}"
    finally:
        cpu.set_isa(previous)
