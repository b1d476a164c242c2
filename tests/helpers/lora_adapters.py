"""Random PEFT LoRA adapters of a real model, saved as PEFT saves them, and the reference
greedy output of each: transformers with the adapter merged by peft (test-only packages)."""

from __future__ import annotations

from dataclasses import dataclass
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.runtime.lora.adapter import module_shapes


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    targets: tuple[str, ...]
    rank: int
    alpha: float
    rslora: bool = False
    seed: int = 0


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_dir: Path, out_dir: Path, specs: list[AdapterSpec], prompts: list[list[int]],
                  max_new_tokens: int) -> tuple[dict[str, Path], dict[str, list[list[int]]]]:
    """Each spec saved under out_dir/name by peft's save_pretrained (random A and B, small
    enough to keep the model fluent but large enough to change its answers), and the greedy
    continuation of each prompt by transformers with the adapter merged (key "" = the base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths: dict[str, Path] = {}
    expected: dict[str, list[list[int]]] = {}

    def base():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    expected[""] = _greedy(base(), prompts, max_new_tokens)
    for spec in specs:
        torch.manual_seed(spec.seed)
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                            use_rslora=spec.rslora, lora_dropout=0.0, init_lora_weights=False)
        model = get_peft_model(base(), config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.04)
        paths[spec.name] = out_dir / spec.name
        model.save_pretrained(paths[spec.name])
        expected[spec.name] = _greedy(model.merge_and_unload().eval(), prompts, max_new_tokens)
    return paths, expected


@torch.inference_mode()
def _greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


BLOCK_SIZE = 16
NEW_TOKENS = 8
TINY_SPECS = [AdapterSpec("all", ALL_TARGETS, 8, 16), AdapterSpec("qv", ("q_proj", "v_proj"), 4, 8, True, 1),
              AdapterSpec("mlp", ("gate_proj", "up_proj", "down_proj"), 16, 16, False, 2)]
"""Three adapters of the real target modules: all seven; q/v with rslora; the MLP at rank 16."""


def tiny_served(root: Path) -> tuple[Path, dict[str, Path], list[list[int]], dict[str, list[list[int]]]]:
    """A small random-weight Llama (two layers, GQA) under root/model, TINY_SPECS's adapters, two
    prompts and the reference greedy tokens of each adapter ("" = the base). Each prompt holds two
    full KV blocks and most of a third, so the prefix cache keeps two blocks of it and its
    NEW_TOKENS need a fourth block."""
    import random

    from services.tools.random_model import build_random_model
    from tests.conftest import STORIES_DIR
    from tests.helpers.parity_specs import PARITY_SPECS

    model = build_random_model(PARITY_SPECS["llama-gqa-8-2"], root / "model", tokenizer_from=STORIES_DIR)
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (2 * BLOCK_SIZE + 12, 2 * BLOCK_SIZE + 14)]
    paths, expected = make_adapters(model, root, TINY_SPECS, prompts, NEW_TOKENS)
    for spec in TINY_SPECS:
        assert expected[spec.name] != expected[""], f"adapter {spec.name} does not change the base's answers"
    return model, paths, prompts, expected


def _stories_config():
    from services.runtime.model.config import ModelConfig
    from tests.conftest import STORIES_DIR

    return ModelConfig.from_model_dir(STORIES_DIR)


STORIES_CONFIG = _stories_config()
"""stories260K's shapes (Llama: hidden 64, MLP 172, 8 heads over 4 KV heads, 5 layers)."""


def write_adapter(directory: Path, rank: int = 4, targets=("q_proj", "v_proj", "down_proj"),
                  config: dict | None = None, tensors: dict | None = None) -> Path:
    """An adapter as PEFT's save_pretrained writes it (random A and B), edited by the arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    shapes = module_shapes(STORIES_CONFIG)
    written = {}
    for layer in range(STORIES_CONFIG.num_layers):
        for module in targets:
            out_features, in_features = shapes[module]
            part = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            written[f"{key}.lora_A.weight"] = torch.randn(rank, in_features)
            written[f"{key}.lora_B.weight"] = torch.randn(out_features, rank)
    written.update(tensors or {})
    save_file(written, directory / "adapter_model.safetensors")
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
            "bias": "none", **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(body))
    return directory


def write_adapter_set(root: Path, seed: int = 7) -> dict[str, str]:
    """The adapters the admin front ends load, under ``root`` (name -> path): r4 and r8 on q, v and
    down, and r2 on o_proj alone (another shape, to replace one of the others)."""
    torch.manual_seed(seed)
    return {"r4": str(write_adapter(root / "r4", rank=4)), "r8": str(write_adapter(root / "r8", rank=8)),
            "r2": str(write_adapter(root / "r2", rank=2, targets=("o_proj",)))}


def write_private_json(path: Path, value: object) -> Path:
    """A credentials file (API keys, engine tokens): JSON, mode 0600, as the services demand."""
    path.write_text(json.dumps(value))
    path.chmod(0o600)
    return path
