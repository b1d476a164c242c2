"""Weight-only quantization: the formats against llama.cpp's reference (the `gguf` package),
QuantLinear against x @ dequantize(W)^T, and quantized stories260K against the float model
that holds the same (dequantized) numbers.

The CPU kernel multiplies the stored numbers in fp32, so a quantized model and its
dequantized twin differ only in the order of fp32 sums: logits within 1e-4 of the logit scale
(the bound the HF parity tests use) and identical greedy tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from safetensors.torch import save_file

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.runtime.model.config import ModelConfig
from services.runtime.model.quant.config import QuantizationConfig
from services.runtime.model.quant.formats import (QuantizedWeight, cat_rows, dequantize, pack_values, quantize,
                                                   unpack_values)
from services.runtime.model.quant.linear import QuantLinear
from services.runtime.model.weights import load_checkpoint
from services.tools.gguf import split_blocks
from services.tools.quantize import main as quantize_main
from services.tools.quantize import quantize_model
from tests.helpers.quant_models import write_dequantized
from tests.tools.gguf_helpers import assert_close_to_reference, engine_logits, load_engine_model

GGUF_TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def gguf_weight(values: np.ndarray, fmt: str) -> tuple[QuantizedWeight, np.ndarray]:
    """llama.cpp's quantization of ``values`` as our parts, and its reference dequantization."""
    blocks = gguf_quants.quantize(values, GGUF_TYPES[fmt])
    parts = {k: torch.from_numpy(v.copy()) for k, v in split_blocks(blocks, fmt).items()}
    return QuantizedWeight.from_parts(fmt, parts, 32), gguf_quants.dequantize(blocks, GGUF_TYPES[fmt])


@pytest.mark.parametrize("fmt", sorted(GGUF_TYPES))
def test_quantize_equals_llama_cpp_reference_byte_for_byte(fmt):
    values = (np.random.default_rng(3).standard_normal((48, 160)) * 0.1).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero group: d = 0 must not divide by zero
    theirs, reference = gguf_weight(values, fmt)
    ours = quantize(torch.from_numpy(values), fmt)
    for name, tensor in theirs.parts().items():
        assert torch.equal(ours.parts()[name].view(torch.uint8), tensor.view(torch.uint8)), f"{fmt} {name} differs"
    # The runtime's reference dequantization is the gguf package's, bit for bit.
    assert torch.equal(dequantize(theirs), torch.from_numpy(reference.reshape(48, 160)))


def test_int8_per_channel_round_trip():
    weight = torch.randn(33, 40) * torch.logspace(-3, 1, 33)[:, None]  # rows of very different scales
    w = quantize(weight, "int8")
    assert w.scales.shape == (33,) and w.qweight.dtype == torch.int8
    err = (dequantize(w) - weight).abs()
    assert (err <= w.scales[:, None] / 2 * (1 + 1e-6)).all(), "an int8 value is not the nearest level"


def test_nibble_order_is_gguf_and_round_trips():
    q = torch.randint(0, 16, (5, 64), dtype=torch.int32)
    packed = pack_values(q)
    assert packed[0, 3] == q[0, 3] | (q[0, 19] << 4)  # byte j of a block: value j low, value j + 16 high
    w = QuantizedWeight("q4_0", 5, 64, 32, packed, torch.ones(5, 2, dtype=torch.float16))
    assert torch.equal(unpack_values(w), q)


def test_cat_rows_refuses_different_formats():
    a, b = quantize(torch.randn(16, 64), "q4_1"), quantize(torch.randn(16, 64), "q8_0")
    with pytest.raises(ValueError, match="cannot fuse a q8_0"):
        cat_rows([a, b])
    fused = cat_rows([a, quantize(torch.randn(8, 64), "q4_1")])
    assert fused.shape == (24, 64) and torch.equal(dequantize(fused)[:16], dequantize(a))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8"])
@pytest.mark.parametrize("rows", [1, 8, 9, 16, 20, 70])
@pytest.mark.parametrize("shape", [(16, 32), (97, 96), (40, 160)])
def test_quant_linear_equals_dequantized_product(fmt, rows, shape):
    n, k = shape
    w = quantize(torch.randn(n, k) * 0.05, fmt)
    layer = QuantLinear(w)
    assert layer.prepare() == "cpu_kernel"
    x = torch.randn(rows, k)
    expected = x @ dequantize(w).t()
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 40])
def test_quant_linear_under_inference_mode_on_several_threads(rows):
    """The model runs under torch.inference_mode with the intra-op pool: the panel path's other
    threads write into the output made under it (they once raised "Inplace update to inference
    tensor outside InferenceMode", failing every prompt of 16+ tokens with two threads)."""
    w = quantize(torch.randn(600, 64) * 0.05, "q4_1")  # enough columns for several panels
    layer = QuantLinear(w)
    assert layer.prepare() == "cpu_kernel"
    x = torch.randn(rows, 64)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            out = layer(x)
    finally:
        torch.set_num_threads(previous)
    expected = x @ dequantize(w).t()
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8"])
def test_auto_activations_take_the_exact_kernel_where_it_runs_the_type(fmt):
    """The executor's default (--quant-activations auto) is faithful first: a type the exact
    kernel runs takes fp32 activations, whose product is the dequantized weight's."""
    w = quantize(torch.randn(48, 64) * 0.05, fmt)
    layer = QuantLinear(w)
    assert layer.prepare("auto") == "cpu_kernel"
    x = torch.randn(3, 64)
    expected = x @ dequantize(w).t()
    torch.testing.assert_close(layer(x), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


def test_quant_linear_group_64_and_fallback_for_odd_input_size():
    w = quantize(torch.randn(48, 128), "q4_1", group_size=64)
    x = torch.randn(5, 128)
    torch.testing.assert_close(QuantLinear(w)(x), x @ dequantize(w).t(), atol=1e-4, rtol=1e-5)
    odd = quantize(torch.randn(10, 40), "int8")  # 40 is not a multiple of the kernel's 32-value blocks
    layer = QuantLinear(odd)
    assert layer.prepare() == "dequantized"
    x = torch.randn(3, 40)
    torch.testing.assert_close(layer(x), x @ dequantize(odd).t(), atol=1e-5, rtol=1e-5)


def test_quantization_config_is_checked():
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        QuantizationConfig.from_dict({"quant_method": "gptq", "format": "q4_1"})
    with pytest.raises(ValueError, match="'format': format must be one of"):
        QuantizationConfig.from_dict({"quant_method": "tokenmill", "format": "q3"})
    quant = QuantizationConfig.from_dict({"quant_method": "tokenmill", "format": "q4_1",
                                          "modules": {"model.embed_tokens": "q8_0", "lm_head": "none"}})
    assert (quant.format_of("model.embed_tokens"), quant.format_of("lm_head"),
            quant.format_of("model.layers.3.mlp.up_proj")) == ("q8_0", None, "q4_1")


# --- stories260K quantized by `tokenmill quantize`, against its dequantized twin ---------------


@pytest.fixture(scope="module", params=["int4", "int8"])
def stories_pair(request, stories_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"stories-{request.param}")
    quant_dir = root / "quantized"
    quantize_model(stories_dir, quant_dir, request.param)
    return quant_dir, write_dequantized(quant_dir, root / "dequantized")


def test_quantized_stories_logits_equal_dequantized(stories_pair):
    quant_dir, float_dir = stories_pair
    model = load_engine_model(quant_dir)
    paths = {m.path for m in model.modules() if isinstance(m, QuantLinear)}
    # int8's down projections (input 172, not a multiple of the kernel's 32-value blocks) run dequantized
    assert "cpu_kernel" in paths and paths <= {"cpu_kernel", "dequantized"}, paths
    ids = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_close_to_reference(engine_logits(model, ids), engine_logits(float_dir, ids))


def test_quantized_stories_greedy_text_equals_dequantized(stories_pair):
    quant_dir, float_dir = stories_pair
    prompts = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]
    outputs = []
    for model_dir in (quant_dir, float_dir):
        # quant_activations none: the exact path, whose numbers are the dequantized model's
        engine = Engine(EngineConfig(ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu",
                                                    quant_activations="none")))
        texts = [""] * len(prompts)
        for i, delta in engine.generate(prompts, SamplingParams(temperature=0.0),
                                        StopConditions(max_tokens=48, ignore_eos=True)):
            texts[i] += delta.text
        outputs.append(texts)
    assert all(len(t) > 40 for t in outputs[0])
    assert outputs[0] == outputs[1]


def test_quantized_checkpoint_is_smaller_and_says_what_it_holds(stories_pair, stories_dir):
    quant_dir, _ = stories_pair
    raw = json.loads((quant_dir / "config.json").read_text())
    quant = QuantizationConfig.from_dict(raw["quantization_config"])
    assert quant.format in ("q4_1", "int8")
    # stories260K's FFN input (172) is not a multiple of 32: the group-wise down projections stay float
    if quant.format == "q4_1":
        assert quant.format_of("model.layers.0.mlp.down_proj") is None
    assert (quant_dir / "model.safetensors").stat().st_size < 0.6 * (stories_dir / "model.safetensors").stat().st_size


def test_quantize_command_refuses_bad_input(stories_pair, tmp_path, capsys):
    quant_dir, _ = stories_pair
    assert quantize_main([str(quant_dir), "--weights", "int8", "--out", str(tmp_path / "x")]) == 1
    assert "already quantized" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quantize_main([str(quant_dir), "--weights", "int3", "--out", str(tmp_path / "y")])


def test_loader_names_a_part_with_the_wrong_dtype(stories_pair, tmp_path):
    quant_dir, _ = stories_pair
    config = ModelConfig.from_model_dir(quant_dir)
    tensors = load_checkpoint(quant_dir, config, torch.float32)
    from safetensors.torch import load_file

    state = load_file(str(quant_dir / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.scales"
    state[name] = state[name].float() if state[name].dtype != torch.float32 else state[name].half()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(state, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((quant_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.q_proj.scales.*expected"):
        load_checkpoint(bad, config, torch.float32)
    assert isinstance(tensors["model.layers.1.self_attn.q_proj.weight"], QuantizedWeight)
    assert dataclasses.replace(config, quantization=None).quantization is None


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8"])
def test_cpu_dequantize_is_bitwise_the_reference(fmt):
    """The weight the CPU path writes out for many rows (quant_dequantize) is the reference's, bit for bit."""
    from services.runtime.model.quant.formats import bits
    from services.runtime.model.quant.linear import cpu_kernel_operands

    w = quantize(torch.randn(40, 96) * 0.1, fmt)
    layer = QuantLinear(w)
    assert layer.prepare() == "cpu_kernel"
    scales, zeros, group = cpu_kernel_operands(w)
    out = torch.ops.tokenmill_quant.quant_dequantize(w.qweight, scales, zeros, bits(fmt), group)
    assert torch.equal(out, dequantize(w))


@pytest.mark.parametrize("fmt", ["q4_1", "int8"])
@pytest.mark.parametrize("panel", [1, 16, 33, 97, 200])
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_cpu_panels_equal_the_dequantized_product(fmt, panel, rows):
    """Panels that divide N, leave a remainder, or exceed N all write every output column once."""
    from services.runtime.model.quant.formats import bits
    from services.runtime.model.quant.linear import cpu_kernel_operands

    w = quantize(torch.randn(97, 160) * 0.05, fmt)
    assert QuantLinear(w).prepare() == "cpu_kernel"
    x = torch.randn(rows, 160)
    expected = x @ dequantize(w).t()
    out = torch.ops.tokenmill_quant.quant_matmul_panels(x, w.qweight, *cpu_kernel_operands(w)[:2], bits(w.fmt),
                                                        cpu_kernel_operands(w)[2], panel)
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)
