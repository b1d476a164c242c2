"""Mixture-of-experts GGUF files (llama.cpp's Mixtral under arch ``llama``, ``qwen3moe``, ``olmoe``,
``qwen2moe``): the router and stacked experts (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``) convert to
transformers' per-expert tensors, Qwen2-MoE's shared expert (``ffn_*_shexp``, its gate a vector) and
q/k/v biases to transformers' names, and the converted model computes what transformers computes on
the weights the file was written from."""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.gguf import convert_gguf
from services.tools.random_model import build_random_model
from tests.helpers.moe_gguf import gguf_spec, kept_moe_model, write_moe_gguf
from tests.helpers.paged_forward import assert_close_to_reference, run_chunks
from tests.tools.gguf_helpers import TOKENS

transformers = pytest.importorskip("transformers")


def _q8_0_round_trip(model_dir) -> None:
    """The reference weights: experts (and a shared expert) as the file holds them (Q8_0), so only
    conversion errors show."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in tensors.items():
        if ".experts." in name or ".shared_expert." in name:
            q = quantize(value.numpy(), GGMLQuantizationType.Q8_0)
            tensors[name] = torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0).reshape(value.shape).copy())
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "olmoe", "qwen2-moe"])
def test_moe_gguf_converts_to_what_transformers_computes(tmp_path, name):
    spec = gguf_spec(name)
    ref_dir = build_random_model(spec, tmp_path / "ref")
    _q8_0_round_trip(ref_dir)
    write_moe_gguf(ref_dir, tmp_path / "moe.gguf", spec)
    convert_gguf(tmp_path / "moe.gguf", tmp_path / "out")
    converted, original = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(
        str(ref_dir / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    for key, value in original.items():
        torch.testing.assert_close(converted[key], value, rtol=0, atol=0, msg=key)
    model = load_model(tmp_path / "out", TorchAttentionBackend())
    assert model.config.architecture == spec.architecture and model.config.moe.top_k == spec.num_experts_per_tok
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, len(TOKENS), (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_close_to_reference(run_chunks(model, ids, [12, 1, 7], [2, 0, 1], 8), ref)


@pytest.mark.parametrize("name,types", [("mixtral", ("q8_0", "q8_0")), ("olmoe", ("q4_k", "q6_k")),
                                        ("qwen2-moe", ("q4_k", "q6_k"))])
def test_keep_runs_experts_in_their_gguf_type(tmp_path, name, types):
    """``--weights keep`` of a MoE file: each expert's blocks stored as they are and multiplied in their type
    by the grouped CPU kernel, within int8 activations' rounding of the dequantized (fp32) conversion."""
    from services.runtime.kernels import cpu

    if not cpu.available():
        pytest.skip("the C++ CPU kernels cannot be built here")
    spec, _ = kept_moe_model(name, types, tmp_path)
    convert_gguf(tmp_path / "moe.gguf", tmp_path / "fp32")
    kept = load_file(str(tmp_path / "keep" / "model.safetensors"))
    gate = next(k for k in kept if re.search(r"layers\.1\..*experts\.7\.(w1|gate_proj)\.qweight", k))
    assert kept[gate].dtype in (torch.uint8, torch.int8) and not any(".experts." in k and k.endswith(".weight")
                                                                      for k in kept)
    if spec.shared_expert_intermediate_size:  # the shared expert kept too, its sigmoid gate in fp32
        assert kept["model.layers.1.mlp.shared_expert.down_proj.qweight"].dtype == torch.uint8
        assert kept["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, spec.hidden_size)
    model = load_model(tmp_path / "keep", TorchAttentionBackend(), quant_activations="auto")
    assert [layer.moe.path for layer in model.layers] == ["cpu_int8"] * 2
    assert model.layers[0].moe.formats == types
    dense = load_model(tmp_path / "fp32", TorchAttentionBackend())
    ids = torch.randint(3, len(TOKENS), (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, ref = run_chunks(model, ids, [12, 1, 7], [2, 0, 1], 8), run_chunks(dense, ids, [12, 1, 7], [2, 0, 1], 8)
    # int8 activations (per 32 values) ahead of every expert product: 1-3.4% of the logits' norm on these
    # random weights (two layers, flat logits), the top token the same at 19-20 of 20 positions.
    assert (ours - ref).norm() <= 0.05 * ref.norm()
    assert (ours.argmax(-1) == ref.argmax(-1)).sum() >= 18
    # none: the kept experts dequantized at load, the fp32 conversion's numbers.
    exact = load_model(tmp_path / "keep", TorchAttentionBackend(), quant_activations="none")
    assert exact.layers[0].moe.path == "dequantized"
    with torch.no_grad():
        assert_close_to_reference(run_chunks(exact, ids, [12, 1, 7], [2, 0, 1], 8), ref)


def _meta(arch: str, **extra) -> dict:
    return {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.block_count": 1, f"{arch}.feed_forward_length": 96, f"{arch}.context_length": 128,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.vocab_size": 32, f"{arch}.expert_count": 4,
            f"{arch}.expert_used_count": 2, f"{arch}.expert_feed_forward_length": 32, **extra}


def test_shared_experts_and_biases_are_placed_or_refused_by_name():
    from services.tools.gguf import hf_tensor_name, llama_config

    shared = {"blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_gate_shexp.weight", "blk.0.attn_q.bias"}
    with pytest.raises(ValueError, match="shared experts .*Qwen3-MoE has no place for"):
        llama_config(_meta("qwen3moe"), shared, torch.float32)
    with pytest.raises(ValueError, match="no 'qwen2moe.expert_shared_feed_forward_length'"):
        llama_config(_meta("qwen2moe"), shared, torch.float32)
    config = llama_config(_meta("qwen2moe", **{"qwen2moe.expert_shared_feed_forward_length": 48}), shared,
                          torch.float32)
    assert (config["architectures"], config["shared_expert_intermediate_size"], config["qkv_bias"],
            config["norm_topk_prob"]) == (["Qwen2MoeForCausalLM"], 48, True, False)
    assert llama_config(_meta("qwen2moe"), set(), torch.float32)["shared_expert_intermediate_size"] == 0
    assert hf_tensor_name("blk.3.attn_k.bias", "qwen2moe") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.ffn_gate_inp_shexp.weight", "qwen2moe") == "model.layers.3.mlp.shared_expert_gate.weight"
    for name, arch in (("blk.3.attn_k.bias", "llama"), ("blk.3.attn_output.bias", "qwen2moe")):
        with pytest.raises(ValueError, match="has no place in the"):
            hf_tensor_name(name, arch)
