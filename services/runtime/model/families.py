"""The model class of each architecture (config.FAMILIES), and loading a model directory with it."""

from __future__ import annotations

from pathlib import Path

import torch

from services.runtime.model.attention.base import AttentionBackend
from services.runtime.model.config import ModelConfig
from services.runtime.model.gemma2 import Gemma2ForCausalLM
from services.runtime.model.gemma3 import Gemma3ForCausalLM
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.model.olmoe import OlmoeForCausalLM
from services.runtime.model.phi3 import Phi3ForCausalLM
from services.runtime.model.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    # Mixture of experts: the same layers, their MLP routed when config.moe says so (moe.py)
    "mixtral": LlamaForCausalLM, "qwen2_moe": LlamaForCausalLM, "qwen3_moe": Qwen3ForCausalLM, "olmoe": OlmoeForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[config.family]


def load_model(model_dir: str | Path, backend: AttentionBackend, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None, config: ModelConfig | None = None, **kwargs) -> LlamaForCausalLM:
    """``model_dir`` loaded with its architecture's class (keyword arguments: ``from_pretrained``'s)."""
    config = config or ModelConfig.from_model_dir(model_dir)
    return model_class(config).from_pretrained(model_dir, backend, device, dtype, config, **kwargs)
