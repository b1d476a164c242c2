"""``tokenmill convert gguf --weights keep`` on a file with K-quants (a Q4_K_M-like mix: Q5_0 and
Q5_1 q/k, Q6_K v, down and head, Q4_K and Q5_K elsewhere): the blocks are stored byte for byte,
and the kept model's logits equal the fp32 conversion's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from safetensors.torch import load_file

from services.runtime.model.quant.linear import QuantLinear, StackedLinear
from services.tools.gguf import convert_gguf, main
from tests.tools.gguf_helpers import assert_close_to_reference, engine_logits, load_engine_model, write_tiny_llama_gguf

DIMS = dict(hidden=256, ffn=512, heads=4, kv_heads=2)
MIX = dict(attn_q=T.Q5_0, attn_k=T.Q5_1, attn_v=T.Q6_K, attn_output=T.Q4_K, ffn_gate=T.Q4_K, ffn_up=T.Q5_K,
           ffn_down=T.Q6_K, output=T.Q6_K, token_embd=T.Q4_K)


@pytest.fixture(scope="module")
def kquant_pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("kquants")
    source = root / "mix.gguf"
    write_tiny_llama_gguf(source, untied=True, dims=DIMS, qtypes=MIX)
    convert_gguf(source, root / "keep", weights="keep")
    convert_gguf(source, root / "fp32", weights="fp32")
    return source, root / "keep", root / "fp32"


def test_keep_stores_k_quant_blocks_byte_for_byte(kquant_pair):
    source, keep, _ = kquant_pair
    quant = json.loads((keep / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "q6_k"  # the most common among the projections (v, down, and the head)
    assert quant["modules"]["model.layers.1.self_attn.q_proj"] == "q5_0"
    assert quant["modules"]["model.layers.0.mlp.up_proj"] == "q5_k"
    assert quant["modules"]["model.embed_tokens"] == "q4_k"
    state = load_file(str(keep / "model.safetensors"))
    tensors = {t.name: t for t in GGUFReader(source).tensors}
    for gguf_name, hf_module in (("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj"),
                                 ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj"),
                                 ("output.weight", "lm_head")):
        t = tensors[gguf_name]
        stored = state[f"{hf_module}.qweight"]
        assert stored.dtype == torch.uint8 and f"{hf_module}.scales" not in state
        assert np.array_equal(stored.numpy(), np.asarray(t.data).reshape(int(t.shape[1]), -1))


def test_kept_k_quant_model_equals_the_fp32_conversion(kquant_pair):
    _, keep, fp32 = kquant_pair
    model = load_engine_model(keep)
    assert isinstance(model.layers[0].qkv, StackedLinear), "q|k|v of three formats run side by side"
    assert {m.quantized.fmt for m in model.modules() if isinstance(m, QuantLinear)} == {
        "q4_k", "q5_k", "q6_k", "q5_0", "q5_1"}
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_close_to_reference(engine_logits(model, ids), engine_logits(fp32, ids))


def test_kept_k_quant_model_with_int8_activations_stays_near_fp32(kquant_pair):
    """The integer kernels (kquant_dot.cpp) in a whole model: every K-quant and q5 projection on
    their path, logits near the fp32 conversion's."""
    from services.runtime.kernels import cpu
    from services.runtime.model.attention.torch_backend import TorchAttentionBackend
    from services.runtime.model.llama import LlamaForCausalLM

    if not cpu.available():
        pytest.skip("the C++ CPU kernels cannot be built here")
    _, keep, fp32 = kquant_pair
    model = LlamaForCausalLM.from_pretrained(keep, TorchAttentionBackend(), quant_activations="int8")
    assert {m.path for m in model.modules() if isinstance(m, QuantLinear)} == {"cpu_kquant"}
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, ref = engine_logits(model, ids), engine_logits(fp32, ids)
    # A random model amplifies rounding layer by layer (the worst logit moves ~8%); the typical one
    # stays near. A wrong kernel moves logits by their own size. SmolLM2's perplexity: docs/benchmarks.md.
    assert (ours - ref).abs().mean() < 0.01 * ref.abs().max()
    # The executor's default (auto) keeps these types in their blocks on the same kernels: they
    # have no exact kernel, and none would dequantize them to fp32.
    default = LlamaForCausalLM.from_pretrained(keep, TorchAttentionBackend(), quant_activations="auto")
    assert {m.path for m in default.modules() if isinstance(m, QuantLinear)} == {"cpu_kquant"}
    torch.testing.assert_close(engine_logits(default, ids), ours, rtol=0, atol=0)


def test_keep_refuses_a_type_it_cannot_run(tmp_path, capsys):
    source = tmp_path / "q2k.gguf"
    write_tiny_llama_gguf(source, dims=DIMS, qtypes=dict(ffn_down=T.Q2_K))
    assert main([str(source), "--out", str(tmp_path / "out"), "--weights", "keep"]) == 1
    assert "tensor blk.0.ffn_down.weight is Q2_K; --weights keep stores" in capsys.readouterr().err
