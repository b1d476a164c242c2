"""Deterministic random-weight Llama-family checkpoints, for benchmarks and tests.

No model can be downloaded, so larger shapes are made here: the same seed always gives
the same bytes. Weights are scaled like a trained network's (std 0.02, norms at 1) so
activations stay in range and greedy decoding does not collapse to one token at once.
"""

from __future__ import annotations

import argparse
import json
import shutil
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE


@dataclass(frozen=True, slots=True)
class RandomModelSpec:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 4
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: str = "float32"
    init_std: float = 0.02
    """Std of the random matrices. Tests raise it so logits spread and greedy choices are far from ties."""
    rope_scaling: tuple[tuple[str, object], ...] = ()
    """config.json's ``rope_scaling`` as (key, value) pairs (a tuple keeps the spec hashable)."""
    sliding_window: int | None = None
    """Mistral: every layer's window; Gemma 3: its local layers' window."""
    sliding_window_pattern: int = 6
    """Gemma 3: every this-many-th layer is global."""
    head_size: int = 0
    """Per-head dimension when it is not hidden_size / num_heads (Gemma 3: 256 at hidden 640)."""
    rope_local_theta: float = 10000.0
    """Gemma 3: the RoPE base of its local layers."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: the cap on attention scores."""
    final_logit_softcapping: float | None = None
    """Gemma 2: the cap on logits."""
    num_experts: int = 0
    """Mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE): the routed experts per sparse layer."""
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    """Each expert's width (Qwen2/3-MoE; Mixtral and OLMoE use intermediate_size)."""
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE: the shared expert's width."""
    mlp_only_layers: tuple[int, ...] = ()
    """Qwen2/3-MoE: layers that keep a dense MLP."""

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        d, f, v, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        if self.num_experts:
            per_layer = attn + 2 * d + self.num_experts * (d + 3 * d * self.expert_size) \
                + 3 * d * self.shared_expert_intermediate_size
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + head + self.num_layers * per_layer + d


PRESETS: dict[str, RandomModelSpec] = {
    # ~100M parameters: the benchmark model.
    "llama-100m": RandomModelSpec(),
    # ~1B parameters: GPU end-to-end decode timing.
    "llama-1b": RandomModelSpec(hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=32,
                                num_kv_heads=8, max_position_embeddings=4096, dtype="bfloat16"),
    "tiny": RandomModelSpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, max_position_embeddings=512),
}


def _config_json(spec: RandomModelSpec) -> dict:
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                  "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe"}
    if spec.architecture not in model_type:
        raise ValueError(f"unsupported architecture {spec.architecture!r}")
    cfg = {
        "architectures": [spec.architecture],
        "model_type": model_type[spec.architecture],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": spec.dtype,
    }
    if spec.rope_scaling:
        cfg["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.rope_scaling}
    if spec.architecture == "MistralForCausalLM":
        cfg["sliding_window"] = spec.sliding_window
    if spec.architecture == "Phi3ForCausalLM":
        cfg["sliding_window"] = spec.sliding_window
        cfg["pad_token_id"] = 0  # Phi3Config's default, 32000, lies past a small vocabulary
        scaling = dict(spec.rope_scaling)
        if "original_max_position_embeddings" in scaling:  # Phi-3 writes it beside rope_scaling
            cfg["original_max_position_embeddings"] = scaling.pop("original_max_position_embeddings")
            cfg["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
    if spec.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        _as_gemma(spec, cfg)
    if spec.architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        cfg["use_sliding_window"] = False
    cfg |= _expert_fields(spec)
    return cfg


def _as_gemma(spec: RandomModelSpec, cfg: dict) -> None:
    """Gemma 2's or 3's fields in place of Llama's: GELU, the query scale, layer types, RoPE per layer type."""
    if spec.architecture == "Gemma3ForCausalLM":
        del cfg["hidden_act"], cfg["rope_theta"]
        layer_types = ["full_attention" if (i + 1) % spec.sliding_window_pattern == 0 else "sliding_attention"
                       for i in range(spec.num_layers)]
        cfg |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": spec.head_dim,
                "sliding_window": spec.sliding_window, "layer_types": layer_types, "rms_norm_eps": 1e-6,
                "attn_logit_softcapping": None, "final_logit_softcapping": None,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta,
                                       **dict(spec.rope_scaling)},
                    "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_theta}}}
        cfg.pop("rope_scaling", None)
        return
    del cfg["hidden_act"], cfg["rope_theta"]
    cfg |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": spec.head_dim,
            "sliding_window": spec.sliding_window, "rms_norm_eps": 1e-6,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)],
            "attn_logit_softcapping": spec.attn_logit_softcapping,
            "final_logit_softcapping": spec.final_logit_softcapping,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta}}


def _expert_fields(spec: RandomModelSpec) -> dict:
    """A mixture-of-experts architecture's fields (none for a dense one)."""
    fields: dict = {}
    if spec.architecture == "MixtralForCausalLM":
        fields |= {"num_local_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
                   "sliding_window": spec.sliding_window}
    if spec.architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        fields |= {"num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
                   "norm_topk_prob": spec.norm_topk_prob}
    if spec.architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        fields |= {"moe_intermediate_size": spec.expert_size, "decoder_sparse_step": 1,
                   "mlp_only_layers": list(spec.mlp_only_layers)}
    if spec.architecture == "Qwen2MoeForCausalLM":
        fields |= {"shared_expert_intermediate_size": spec.shared_expert_intermediate_size, "qkv_bias": True}
    if spec.architecture == "OlmoeForCausalLM":
        fields |= {"clip_qkv": None, "pad_token_id": 0}
    return fields


SPACE = "\u2581"  # sentencepiece's word-boundary marker
# Ids 0..2 match the bos_token_id / eos_token_id written in config.json.
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")
NUM_BYTE_PIECES = 256
MIN_SYNTHETIC_VOCAB = len(SPECIAL_PIECES) + NUM_BYTE_PIECES


def write_synthetic_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Write tokenizer.json + tokenizer_config.json with exactly ``vocab_size`` ids.

    A random-weight model has no trained tokenizer, but the engine needs one to detokenize.
    This one is a sentencepiece-style BPE with byte fallback and no merges: ids 0..2 are
    <unk> <s> </s>, 3..258 the byte pieces <0x00>..<0xFF>, then "\u2581" and printable ASCII
    (so ASCII text encodes one character per token), then filler pieces "\u2581w<id>" that
    encoding never produces but decoding spells out, so any sampled id has visible text.
    """
    if vocab_size < MIN_SYNTHETIC_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is below {MIN_SYNTHETIC_VOCAB}, the specials plus 256 byte pieces")
    pieces = list(SPECIAL_PIECES) + [f"<0x{b:02X}>" for b in range(NUM_BYTE_PIECES)]
    chars = [SPACE] + [c for c in string.printable if c.isprintable() and c != " "]
    pieces += chars[: vocab_size - len(pieces)]
    pieces += [f"{SPACE}w{i}" for i in range(len(pieces), vocab_size)]
    tokenizer = Tokenizer(BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in SPECIAL_PIECES])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", special_tokens=[("<s>", 1)])
    out = Path(out_dir)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _expert_tensors(spec: RandomModelSpec, p: str, rand) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts under transformers' checkpoint names, in place of its MLP's."""
    d, f = spec.hidden_size, spec.expert_size
    block, gate, up, down = ("block_sparse_moe.", "w1", "w3", "w2") if spec.architecture == "MixtralForCausalLM" \
        else ("mlp.", "gate_proj", "up_proj", "down_proj")
    out = {f"{p}{block}gate.weight": rand(spec.num_experts, d)}
    for e in range(spec.num_experts):
        out |= {f"{p}{block}experts.{e}.{gate}.weight": rand(f, d), f"{p}{block}experts.{e}.{up}.weight": rand(f, d),
                f"{p}{block}experts.{e}.{down}.weight": rand(d, f)}
    if spec.shared_expert_intermediate_size:
        s = spec.shared_expert_intermediate_size
        out |= {f"{p}mlp.shared_expert.gate_proj.weight": rand(s, d), f"{p}mlp.shared_expert.up_proj.weight": rand(s, d),
                f"{p}mlp.shared_expert.down_proj.weight": rand(d, s), f"{p}mlp.shared_expert_gate.weight": rand(1, d)}
    return out


class _Draws:
    """The model's random tensors, drawn in order from one seeded generator."""

    def __init__(self, spec: RandomModelSpec) -> None:
        self.gen = torch.Generator().manual_seed(spec.seed)
        self.std = spec.init_std
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype]

    def rand(self, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * self.std).to(self.dtype)

    def ones(self, n: int) -> torch.Tensor:
        # Around 1 but not exactly, so a norm weight that is dropped or misplaced shows.
        return (1.0 + 0.1 * torch.randn(n, generator=self.gen)).to(self.dtype)


def _layer_tensors(spec: RandomModelSpec, i: int, draws: _Draws) -> dict[str, torch.Tensor]:
    """Layer ``i``'s weights under transformers' names for the architecture (unfused)."""
    d, f, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    rand, ones = draws.rand, draws.ones
    p = f"model.layers.{i}."
    tensors = {
        p + "self_attn.q_proj.weight": rand(spec.num_heads * hd, d),
        p + "self_attn.k_proj.weight": rand(spec.num_kv_heads * hd, d),
        p + "self_attn.v_proj.weight": rand(spec.num_kv_heads * hd, d),
        p + "self_attn.o_proj.weight": rand(d, spec.num_heads * hd),
        p + "mlp.gate_proj.weight": rand(f, d),
        p + "mlp.up_proj.weight": rand(f, d),
        p + "mlp.down_proj.weight": rand(d, f),
        p + "input_layernorm.weight": ones(d),
        p + "post_attention_layernorm.weight": ones(d),
    }
    if spec.architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"):
        tensors |= {p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd)}
    if spec.architecture == "OlmoeForCausalLM":  # over the whole q and k widths
        tensors |= {p + "self_attn.q_norm.weight": ones(spec.num_heads * hd),
                    p + "self_attn.k_norm.weight": ones(spec.num_kv_heads * hd)}
    if spec.sparse(i):  # the routed experts replace the MLP
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[p + f"mlp.{name}.weight"]
        tensors |= _expert_tensors(spec, p, rand)
    if spec.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        tensors |= {p + "pre_feedforward_layernorm.weight": ones(d), p + "post_feedforward_layernorm.weight": ones(d)}
    if spec.architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        tensors |= {
            p + "self_attn.q_proj.bias": rand(spec.num_heads * hd) * 10,
            p + "self_attn.k_proj.bias": rand(spec.num_kv_heads * hd) * 10,
            p + "self_attn.v_proj.bias": rand(spec.num_kv_heads * hd) * 10,
        }
    if spec.architecture == "Phi3ForCausalLM":  # q|k|v and gate|up in one matrix each
        tensors[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [tensors.pop(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")])
        tensors[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [tensors.pop(p + "mlp.gate_proj.weight"), tensors.pop(p + "mlp.up_proj.weight")])
    return tensors


def build_random_model(spec: RandomModelSpec, out_dir: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Write config.json and model.safetensors, plus tokenizer files: copied from
    ``tokenizer_from`` when given, else a synthetic tokenizer (when the vocabulary has room for one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    draws = _Draws(spec)
    tensors = {"model.embed_tokens.weight": draws.rand(spec.vocab_size, spec.hidden_size),
               "model.norm.weight": draws.ones(spec.hidden_size)}
    for i in range(spec.num_layers):
        tensors |= _layer_tensors(spec, i, draws)
    if spec.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        # Gemma's norms scale by 1 + w: stored weights around 0, not 1
        tensors |= {name: t - 1.0 for name, t in tensors.items() if name.endswith("norm.weight")}
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = draws.rand(spec.vocab_size, spec.hidden_size)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config_json(spec), indent=2) + "\n")
    (out / "random_model_spec.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = Path(tokenizer_from) / name
            if src.is_file():
                shutil.copy(src, out / name)
    elif spec.vocab_size >= MIN_SYNTHETIC_VOCAB:
        write_synthetic_tokenizer(out, spec.vocab_size)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a deterministic random-weight Llama-family model directory.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-100m")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    spec = PRESETS[args.preset]
    spec = RandomModelSpec(**{**asdict(spec), "seed": args.seed})
    build_random_model(spec, args.out)
    print(f"wrote {args.out} ({spec.num_parameters() / 1e6:.1f}M parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
