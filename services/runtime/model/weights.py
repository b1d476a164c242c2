"""Loading checkpoint tensors from safetensors files, strictly.

Safetensors only: pickle-based files (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) can run
arbitrary code when loaded, so a directory that only has those is refused with an error
that says how to convert it. Every expected tensor must be present with its exact shape;
the error names the tensor and both shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.runtime.model.config import ModelConfig
from services.runtime.model.moe import expert_weight_names
from services.runtime.model.quant.checkpoint import assemble, split_expected

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers some exporters write that are recomputed here, not weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def find_safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({_shard_path(model_dir, name) for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{model_dir} holds only pickle weight files ({', '.join(pickles)}); tokenmill loads "
            "safetensors only, because unpickling can execute code. Convert them to *.safetensors first."
        )
    raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")


def _shard_path(model_dir: Path, name: object) -> Path:
    """A shard named in the index, which must be a file of the model directory itself: a name
    such as "../x", an absolute path or a symlink out would read weights from elsewhere."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or Path(name).name != name:
        raise ValueError(f"model.safetensors.index.json names shard {name!r}; shards must be plain file names "
                         f"in the model directory")
    path = model_dir / name
    if path.exists() and path.resolve().parent != model_dir.resolve():
        raise ValueError(f"model.safetensors.index.json names shard {name!r}, which leads out of the model directory")
    return path


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, d),
            p + "self_attn.k_proj.weight": (kv_out, d),
            p + "self_attn.v_proj.weight": (kv_out, d),
            p + "self_attn.o_proj.weight": (d, q_out),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
        if config.sparse(i):  # the routed experts in place of the MLP (moe.py)
            for name in ("gate_proj", "up_proj", "down_proj"):
                del shapes[p + f"mlp.{name}.weight"]
            shapes |= expert_weight_names(config, p)
        if config.family == "phi3":  # q|k|v and gate|up stored fused (phi3.py splits them)
            for name in ("q_proj", "k_proj", "v_proj"):
                del shapes[p + f"self_attn.{name}.weight"]
            del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
            shapes |= {p + "self_attn.qkv_proj.weight": (q_out + 2 * kv_out, d), p + "mlp.gate_up_proj.weight": (2 * f, d)}
        if config.qk_norm:
            per_head = config.qk_norm_per_head  # else OLMoE's norms over the whole q and k widths
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim if per_head else q_out,),
                       p + "self_attn.k_norm.weight": (config.head_dim if per_head else kv_out,)}
        if config.family in ("gemma2", "gemma3"):  # norms after attention and around the MLP
            shapes |= {p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)}
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
    return shapes


def load_checkpoint(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read every expected tensor (cast to ``dtype``, on the CPU) and check names and shapes.

    A quantized checkpoint (``config.quantization``) stores some weights as parts, read with
    their own dtypes and returned as QuantizedWeights under the weight's name (quant/checkpoint.py).
    """
    model_dir = Path(model_dir)
    expected = layout = expected_shapes(config)
    quant = config.quantization
    parts: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if quant is not None:
        expected, parts = split_expected(layout, quant, config.num_layers, config.tie_word_embeddings)
        expected |= {name: shape for name, (shape, _) in parts.items()}
    tensors: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path in find_safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    # A tied checkpoint may still carry a copy of the embedding as lm_head.
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    unexpected.append(name)
                    continue
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != expected[name]:
                    raise ValueError(
                        f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, "
                        f"expected {expected[name]} from config.json"
                    )
                if name in parts:
                    if tensor.dtype != parts[name][1]:
                        raise ValueError(f"tensor {name!r} in {path.name} is {tensor.dtype}, expected {parts[name][1]} "
                                         "for its quantization format")
                    tensors[name] = tensor
                    continue
                tensors[name] = tensor.to(dtype)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint in {model_dir} is missing tensor(s): {', '.join(missing[:5])}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(
            f"checkpoint in {model_dir} has tensor(s) the {config.architecture} layout does not use: "
            f"{', '.join(sorted(unexpected)[:5])}{more}"
        )
    if quant is not None:
        return assemble(tensors, quant, config.num_layers, config.tie_word_embeddings, layout)
    return tensors
