"""Shared fixtures: the shipped default model and small random-weight model directories."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter. This must be set before anything
# imports triton, and the root conftest is loaded first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread: on a small shared CPU a second OpenMP thread makes small ops wait for
    # a descheduled peer (measured up to 10x slower); results do not depend on it.
    torch.set_num_threads(1)

import pytest

from services.common.model.random_model import RandomModelSpec, build_random_model

REPO_ROOT = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO_ROOT / "models" / "stories260K"

# Random-weight configurations covering the supported architectures and attention layouts.
PARITY_SPECS = {
    "llama-gqa-8-2": RandomModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                                     num_heads=8, num_kv_heads=2, max_position_embeddings=512, init_std=0.15, seed=1),
    "llama-mqa": RandomModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                                 num_heads=8, num_kv_heads=1, max_position_embeddings=512, init_std=0.15, seed=2,
                                 tie_word_embeddings=True),
    "mistral": RandomModelSpec(architecture="MistralForCausalLM", vocab_size=512, hidden_size=128,
                               intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                               max_position_embeddings=512, init_std=0.15, seed=3, rope_theta=1e6),
    "qwen2-bias": RandomModelSpec(architecture="Qwen2ForCausalLM", vocab_size=512, hidden_size=128,
                                  intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                  max_position_embeddings=512, init_std=0.15, seed=4),
}


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    assert (STORIES_DIR / "config.json").is_file(), "the default model must ship in models/stories260K"
    return STORIES_DIR


@pytest.fixture(scope="session")
def random_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random_models")
    return {name: build_random_model(spec, root / name, tokenizer_from=STORIES_DIR if spec.vocab_size >= 512 else None)
            for name, spec in PARITY_SPECS.items()}
