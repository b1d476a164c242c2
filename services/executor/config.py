"""Executor configuration: which model, where, in what precision, and how much KV memory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ExecutorConfig:
    model: str
    """Path of a Hugging Face-style model directory (config.json, *.safetensors, tokenizer.json)."""
    dtype: str = "auto"
    """fp32, bf16, fp16, or auto (the checkpoint's dtype; fp32 on CPU when it is half precision)."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    attention_backend: str = "auto"
    """torch, triton, or auto (triton on CUDA, torch on CPU)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_bytes: int = 2 * 1024**3
    """KV pool budget on CPU, in bytes (all layers, K and V)."""
    gpu_memory_utilization: float = 0.90
    """On CUDA, the fraction of total device memory the process may use: weights, activations and the KV pool."""
    num_blocks: int = 0
    """Force an exact number of KV blocks (0 = size from the memory budget). Tests use it."""
    max_model_len: int = 0
    """Cap on context length (0 = the model's own limit)."""
    seed: int = 0
    """Seed of the shared generator used for unseeded sampling."""

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_blocks < 0 or self.max_model_len < 0:
            raise ValueError("num_blocks and max_model_len must be >= 0")
